"""`flightdeck submit SPEC.toml`: check a job spec, ship its folder (services/tools/codeship.py) and append
JobSubmitted (services/tools/client.py); prints the job id alone on stdout (so `JOB=$(flightdeck submit job.toml)`
works)."""

import argparse
import asyncio
import os
from pathlib import Path

from flightdeck.services.shell.broker import nats_url
from flightdeck.services.shell.objects.code import CodeError
from flightdeck.services.shell.objects.open import OBJECTS_ENV, objects_url, open_store
from flightdeck.services.shell.objects.store import ObjectStoreError
from flightdeck.services.tools import codeship
from flightdeck.services.tools.cli import (
    EXIT_INVALID,
    Command,
    UserError,
    add_json_argument,
    add_nats_argument,
    print_json,
)
from flightdeck.services.tools.client import Client, read_spec
from flightdeck.services.tools.console import upstate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC.toml", nargs="?", help="the job spec (see examples/drill.toml); "
                        "its [init_from] starts it from another (ended) job's checkpoint")
    parser.add_argument("--resume-from", metavar="JOB", default=None,
                        help="instead of a spec: a new job that continues the ended JOB (failed, cancelled) from its "
                        "newest good checkpoint, with JOB's spec and code; recorded in both histories")
    parser.add_argument("--code", metavar="DIR", default=None,
                        help="the folder to ship to every node with an entrypoint job (default: the spec's folder; "
                        "leave files out in its .flightdeckignore, else .gitignore); the ranks run in their node's "
                        "copy, in entrypoint.cwd inside it")
    parser.add_argument("--no-code", action="store_true",
                        help="ship nothing: the code is on every node already (entrypoint.cwd names where)")
    add_json_argument(parser, "the job id")
    parser.add_argument("--wait", action="store_true", help="then follow it live until it ends, as `flightdeck "
                        "watch` does (exit 0 only if it completed)")
    add_nats_argument(parser)


def store_url(broker: str) -> str:
    """The object store the platform at `broker` reads code from: `$FLIGHTDECK_OBJECTS`, else what the
    `flightdeck up` serving that broker recorded, else this folder's `.flightdeck/objects` if it exists."""
    if os.environ.get(OBJECTS_ENV):
        return os.environ[OBJECTS_ENV]
    data_dir = upstate.find_by_url(broker)
    state = upstate.read_state(data_dir) if data_dir is not None else None
    if state is not None:
        return state.objects or str(Path(state.data_dir) / "objects")
    url = objects_url()
    if "://" not in url and not Path(url).is_dir():
        raise CodeError(f"where does the platform at {broker} keep its objects? No `flightdeck up` here serves "
                        f"it and {url} does not exist: set ${OBJECTS_ENV} to the platform's object store (a folder "
                        "every node reads, or s3://bucket)")
    return url


def run(args: argparse.Namespace) -> int:
    if (args.spec is None) == (args.resume_from is None):
        raise UserError("name a job spec (SPEC.toml) or --resume-from JOB, one of them", EXIT_INVALID)
    if args.json and args.wait:
        raise UserError("--json prints the job id and returns; follow it with `flightdeck watch`, then read "
                        "`flightdeck status JOB --json`", EXIT_INVALID)
    url = nats_url(args.nats)
    if args.resume_from is not None:
        async def resume() -> str:
            async with await Client.connect(url) as fd:
                return await fd.resume_from(args.resume_from)
        return _submitted(asyncio.run(resume()), url, args.wait, args.json)
    spec = read_spec(Path(args.spec))
    folder = Path(args.code) if args.code else Path(args.spec).resolve().parent

    async def go() -> str:
        async with await Client.connect(url) as fd:
            shipped = spec
            if codeship.ships(spec) and not args.no_code:
                try:
                    async with open_store(store_url(url)) as objects:
                        shipped = await codeship.ship(spec, folder, objects)
                except (CodeError, ObjectStoreError, ValueError) as exc:
                    raise UserError(f"{args.spec}: the job's code cannot be shipped: {exc}", EXIT_INVALID) from None
            return await fd.submit(shipped)

    return _submitted(asyncio.run(go()), url, args.wait, args.json)


def _submitted(job_id: str, url: str, wait: bool, as_json: bool = False) -> int:
    if as_json:
        print_json({"job_id": job_id})
        return 0
    print(job_id, flush=True)
    if wait:
        from flightdeck.services.tools.console.watch_cmd import watch  # rich loads only for a watch

        return watch(url, job_id)
    return 0


COMMAND = Command("submit", "submit a job from its TOML spec; prints the job id", add_arguments, run)
