"""The node agent's one start-up, shared by `python -m flightdeck.services.agent` and `flightdeck agent`: its arguments,
their defaults from the environment `flightdeck up` sets, and the run until SIGTERM/SIGINT."""

import argparse
import asyncio
import os
import signal
import sys

from flightdeck.events import subjects
from flightdeck.events.nodelocal import STEP_REPORTS, STEP_REPORTS_ENV
from flightdeck.services.agent import snapshots
from flightdeck.services.agent.inventory import DEFAULT_CPU_SLOTS, AgentError
from flightdeck.services.agent.main import HEARTBEATS, HEARTBEATS_ENV, PRELOAD_ENV, STANDBY_ENV, AgentOptions, run_agent
from flightdeck.services.shell.logging import configure
from flightdeck.services.shell.objects.open import DATA_DIR_ENV, OBJECTS_ENV
from flightdeck.services.shell.stacks import dump_on_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", metavar="URL", help="broker URL (default: $FLIGHTDECK_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--node", help="this node's name (default: the host name)")
    p.add_argument("--slots", type=int, help=f"slots to offer (default: every GPU, else {DEFAULT_CPU_SLOTS} CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help=f"specs, logs, staging, checkpoint cache (default: ${DATA_DIR_ENV} or ./.flightdeck)")
    p.add_argument("--objects", default=None,
                   help=f"committed checkpoints' object store (default: ${OBJECTS_ENV}, else <data-dir>/objects)")
    p.add_argument("--address", default="127.0.0.1", help="where other nodes reach this node's rank 0")
    p.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM to SIGKILL when ranks are stopped")
    p.add_argument("--selfcheck-timeout-s", type=float, default=300.0, help="a self-check still running then fails")
    p.add_argument("--standby", type=int, default=None, metavar="N",
                   help=f"warm standby ranks (torch imported) for fast restarts; 0: none "
                        f"(default: ${STANDBY_ENV}, else one per slot and one more)")
    p.add_argument("--preload", default=None, metavar="MODULES",
                   help=f"comma-separated modules the node's fork server imports besides torch and the trainer, so "
                        f"ranks of jobs that use them start with them imported, e.g. "
                        f"transformers.models.gpt2.modeling_gpt2 (default: ${PRELOAD_ENV})")
    p.add_argument("--snapshots", default=None, metavar="DIR",
                   help="where ranks keep their host snapshots (train.snapshot_every), persisted by this agent when "
                        "a rank fails: a folder on tmpfs; off: none (default: a folder under /dev/shm)")
    p.add_argument("--snapshot-memory", type=snapshots.parse_size, default=None, metavar="SIZE",
                   help="the most the ranks' host snapshots may take of this node's memory, e.g. 64G or 512M; grants "
                        "that would pass it run those ranks without snapshots (default: what the folder has free)")
    p.add_argument("--heartbeats", choices=HEARTBEATS, default=None,
                   help=f"node: relay the ranks' heartbeats in one batch per job per interval; rank: each rank "
                        f"publishes its own (default: ${HEARTBEATS_ENV}, else node)")
    p.add_argument("--step-reports", choices=STEP_REPORTS, default=None,
                   help=f"rank0: only rank 0 publishes a StepCompleted per step, the others' steps ride the "
                        f"heartbeat batches (fleets of thousands of ranks); default: ${STEP_REPORTS_ENV}, else all")


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT; AgentError for arguments or an environment it cannot use."""
    if args.slots is not None and args.slots < 1:
        raise AgentError("--slots must be at least 1")
    if args.standby is not None and args.standby < 0:
        raise AgentError("--standby must be 0 or more")
    if not sys.stderr.isatty():
        configure()  # a log file (under `up`, systemd, Kubernetes): JSON lines, like every service's log

    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        dump_on_signal(loop)
        options = AgentOptions(nats=args.nats, node=args.node, slots=args.slots, device=args.device,
                               data_dir=args.data_dir or os.environ.get(DATA_DIR_ENV) or ".flightdeck",
                               objects=args.objects or os.environ.get(OBJECTS_ENV) or None, address=args.address,
                               grace_s=args.grace_s, selfcheck_timeout_s=args.selfcheck_timeout_s,
                               standby=args.standby, heartbeats=args.heartbeats, step_reports=args.step_reports,
                               preload=args.preload, snapshots=args.snapshots,
                               snapshot_memory=args.snapshot_memory)
        return await run_agent(options, stop)

    try:
        return asyncio.run(go())
    except subjects.InvalidSubjectToken as exc:
        raise AgentError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flightdeck.services.agent", description=__doc__)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except AgentError as exc:
        print(f"python -m flightdeck.services.agent: {exc}", file=sys.stderr)
        return 2
