"""The read-only web server: /metrics from the event log (`flightdeck ui`)."""
