"""The platform's Python client for automation: `from flightdeck.client import Client` (services/tools/client.py)."""

from events.store import Stored
from services.tools.client import Client, ClientError
from services.tools.history.jobview import ENDED, JobView

__all__ = ["ENDED", "Client", "ClientError", "JobView", "Stored"]
