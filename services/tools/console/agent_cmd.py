"""`flightdeck agent`: run a node agent in the foreground, so another host's slots join the fleet; the same
start-up as `python -m flightdeck.services.agent` (services/agent/bootstrap.py), which `flightdeck up` runs too."""

import argparse

from flightdeck.services.agent import bootstrap
from flightdeck.services.agent.inventory import AgentError
from flightdeck.services.tools.cli import EXIT_NOT_FOUND, Command, UserError


def run(args: argparse.Namespace) -> int:
    try:
        return bootstrap.run(args)
    except AgentError as exc:
        raise UserError(str(exc), EXIT_NOT_FOUND) from None


COMMAND = Command("agent", "run a node agent here: this host's slots join the fleet", bootstrap.add_arguments, run)
