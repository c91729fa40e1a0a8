"""`flightdeck agent`: run a node agent in the foreground (services/resources/agent.py), so another host's
slots join the fleet; `flightdeck up` runs one for its own host the same way.

Defaults follow `flightdeck up`'s environment, so the agent it starts shares the services' data dir and
object store: --data-dir from $FLIGHTDECK_DATA_DIR (else ./.flightdeck), --objects from $FLIGHTDECK_OBJECTS
(else <data-dir>/objects).
"""

import argparse
import asyncio
import os
import signal
import sys

from events import subjects
from services import logging as service_logging
from services.checkpoints.service import DATA_DIR_ENV, OBJECTS_ENV
from services.console.cli import EXIT_NOT_FOUND, Command, UserError, add_nats_argument
from services.resources.agent import add_heartbeat_arguments, add_standby_argument, run_agent
from services.resources.inventory import DEFAULT_CPU_SLOTS, AgentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    parser.add_argument("--node", help="this node's name (default: the host name)")
    parser.add_argument("--slots", type=int, help=f"slots to offer (default: every GPU, else {DEFAULT_CPU_SLOTS} CPU)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--data-dir", default=None,
                        help=f"specs, logs, staging, checkpoint cache (default: ${DATA_DIR_ENV} or ./.flightdeck)")
    parser.add_argument("--objects", default=None,
                        help=f"committed checkpoints' object store (default: ${OBJECTS_ENV}, else <data-dir>/objects)")
    parser.add_argument("--address", default="127.0.0.1", help="where other nodes reach this node's rank 0")
    parser.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM to SIGKILL when ranks are stopped")
    add_standby_argument(parser)
    add_heartbeat_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.slots is not None and args.slots < 1:
        raise UserError("--slots must be at least 1", EXIT_NOT_FOUND)
    if args.standby is not None and args.standby < 0:
        raise UserError("--standby must be 0 or more", EXIT_NOT_FOUND)
    if not sys.stderr.isatty():
        service_logging.configure()  # under `up` (or any log file): JSON lines, like every service's log

    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_agent(nats=args.nats, node=args.node, slots=args.slots, device=args.device,
                               data_dir=args.data_dir or os.environ.get(DATA_DIR_ENV) or ".flightdeck",
                               objects=args.objects or os.environ.get(OBJECTS_ENV) or None,
                               address=args.address, grace_s=args.grace_s, standby=args.standby,
                               heartbeats=args.heartbeats, step_reports=args.step_reports, stop_event=stop)

    try:
        return asyncio.run(go())
    except (AgentError, subjects.InvalidSubjectToken) as exc:
        raise UserError(str(exc), EXIT_NOT_FOUND) from None


COMMAND = Command("agent", "run a node agent here: this host's slots join the fleet", add_arguments, run)
