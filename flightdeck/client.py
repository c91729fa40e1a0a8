"""The platform's Python client for automation: `from flightdeck.client import Client` (services/tools/client.py)."""

from flightdeck.events.store import Stored
from flightdeck.services.tools.client import Client, ClientError
from flightdeck.services.tools.history.jobview import ENDED, JobView

__all__ = ["ENDED", "Client", "ClientError", "JobView", "Stored"]
