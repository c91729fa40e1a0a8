"""`flightdeck submit SPEC.toml`: check a job spec and append JobSubmitted (services/tools/client.py); prints the
job id alone on stdout (so `JOB=$(flightdeck submit job.toml)` works)."""

import argparse
import asyncio
from pathlib import Path

from services.shell.broker import nats_url
from services.tools.cli import Command, add_nats_argument
from services.tools.client import Client, read_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC.toml", help="the job spec (see examples/drill.toml)")
    parser.add_argument("--wait", action="store_true", help="then follow it live until it ends, as `flightdeck "
                        "watch` does (exit 0 only if it completed)")
    add_nats_argument(parser)


def run(args: argparse.Namespace) -> int:
    spec = read_spec(Path(args.spec))
    url = nats_url(args.nats)

    async def go() -> str:
        async with await Client.connect(url) as fd:
            return await fd.submit(spec)

    job_id = asyncio.run(go())
    print(job_id, flush=True)
    if args.wait:
        from services.tools.console.watch_cmd import watch  # rich loads only for a watch

        return watch(url, job_id)
    return 0


COMMAND = Command("submit", "submit a job from its TOML spec; prints the job id", add_arguments, run)
