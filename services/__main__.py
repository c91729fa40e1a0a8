"""`python -m flightdeck.services NAME [--nats URL]`: run one service until SIGTERM/SIGINT, then drain and exit 0."""

import argparse
import asyncio
import signal
import sys
from typing import Any

import structlog

from flightdeck.events.streams import BrokerRefused
from flightdeck.services import registry
from flightdeck.services.core import Service
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.shell.logging import configure
from flightdeck.services.shell.runtime import ConsumerPolicy, PublishDenied, run_service
from flightdeck.services.shell.stacks import dump_on_signal

log = structlog.get_logger("flightdeck.service")


async def _run(service: Service[Any], url: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dump_on_signal(loop)
    log.info("starting", service=service.name, nats=url)
    try:
        await run_service(service, url, stop_event=stop, policy=ConsumerPolicy.from_env())
    except (PublishDenied, BrokerRefused) as exc:
        log.error("service stopped", service=service.name, error=str(exc))
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flightdeck.services", description=__doc__)
    parser.add_argument("name", help=f"the service to run: one of {', '.join(registry.names())}")
    parser.add_argument("--nats", help="broker URL (default: $FLIGHTDECK_NATS_URL or nats://127.0.0.1:4222)")
    args = parser.parse_args(argv)
    configure()
    try:
        service = registry.build(args.name)
    except registry.UnknownService as exc:
        print(f"python -m flightdeck.services: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_run(service, nats_url(args.nats)))


if __name__ == "__main__":
    sys.exit(main())
