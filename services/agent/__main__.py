"""`python -m flightdeck.services.agent [--help]`: run this host's node agent (bootstrap.py)."""

import sys

from flightdeck.services.agent.bootstrap import main

if __name__ == "__main__":
    sys.exit(main())
