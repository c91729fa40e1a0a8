"""Broker security: per-service, per-agent and per-job NATS users with subject permissions (permissions.py),
their secrets (passwords.py), the config the broker loads (render.py) and how clients present them
(credentials.py). `python -m flightdeck.services.shell.security --help` writes the config."""
