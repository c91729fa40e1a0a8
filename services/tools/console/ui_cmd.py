"""`flightdeck ui [--nats URL] [--host 127.0.0.1] [--port 8321]`: the read-only web server on any broker: the live
dashboard at `/` (jobs, one job's curves, incidents, checkpoints, decisions and output, the fleet), `/metrics` for
Prometheus (figures from the event log, agreeing with `postmortem`) and `/healthz`."""

import argparse
import asyncio
import signal

from flightdeck.events.store import StoreUnavailable
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, UserError, add_nats_argument, unreachable
from flightdeck.services.tools.web.server import serve

DEFAULT_PORT = 8321
LOOPBACK = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    parser.add_argument("--host", default=LOOPBACK,
                        help=f"address to listen on (default: {LOOPBACK}; it is read-only, but bind wider knowingly)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default: {DEFAULT_PORT})")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: choose 0-65535")
    url = nats_url(args.nats)

    async def go() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: print(f"flightdeck ui: dashboard http://{args.host}:{f.result()}/, metrics "
                                                f"http://{args.host}:{f.result()}/metrics", flush=True))
        await serve(url, args.host, args.port, stop, ready=ready)

    try:
        asyncio.run(go())
    except StoreUnavailable:
        raise unreachable(url) from None
    except OSError as exc:  # the port is taken, or the address is not this machine's
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0


COMMAND = Command("ui", "serve the live dashboard and /metrics (Prometheus) for a platform, read-only", add_arguments,
                  run)
