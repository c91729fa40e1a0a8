"""`flightdeck ui [--nats URL] [--host 127.0.0.1] [--port 8321] [--operator-token-file FILE]`: the web server on any
broker: the live dashboard at `/` (jobs, one job's page, the fleet), `/metrics` for Prometheus (figures from the
event log, agreeing with `postmortem`) and `/healthz`. Read-only unless given an operator token: then a person who
presents it on the page may cancel, pause, resume, checkpoint and roll back jobs."""

import argparse
import asyncio
import os
import signal
from pathlib import Path

from flightdeck.events.store import StoreUnavailable
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, UserError, add_nats_argument, unreachable
from flightdeck.services.tools.web.server import serve

DEFAULT_PORT = 8321
TOKEN_ENV = "FLIGHTDECK_UI_TOKEN_FILE"
MIN_TOKEN = 16  # characters: a guessable token is no gate
LOOPBACK = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser)
    parser.add_argument("--host", default=LOOPBACK,
                        help=f"address to listen on (default: {LOOPBACK}; it is read-only, but bind wider knowingly)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default: {DEFAULT_PORT})")
    parser.add_argument("--operator-token-file", metavar="FILE", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"a file holding the token the page must present to act on jobs (default: ${TOKEN_ENV}; "
                             "none: read-only). `flightdeck up` makes one in its data dir")


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise UserError(f"--operator-token-file {path}: {exc.strerror or exc}") from None
    if len(token) < MIN_TOKEN:
        raise UserError(f"--operator-token-file {path}: the token must be at least {MIN_TOKEN} characters")
    return token


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: choose 0-65535")
    url = nats_url(args.nats)
    token = read_token(args.operator_token_file) if args.operator_token_file else None

    async def go() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: print(f"flightdeck ui: dashboard http://{args.host}:{f.result()}/, metrics "
                                                f"http://{args.host}:{f.result()}/metrics", flush=True))
        await serve(url, args.host, args.port, stop, ready=ready, token=token)

    try:
        asyncio.run(go())
    except StoreUnavailable:
        raise unreachable(url) from None
    except OSError as exc:  # the port is taken, or the address is not this machine's
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0


COMMAND = Command("ui", "serve the live dashboard and /metrics (Prometheus) for a platform", add_arguments, run)
