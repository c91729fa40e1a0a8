"""`flightdeck submit SPEC.toml`: check a job spec and append JobSubmitted; prints the job id alone on stdout
(so `JOB=$(flightdeck submit job.toml)` works)."""

import argparse
import asyncio
import secrets
import time
import uuid
from pathlib import Path

import structlog

from events import subjects
from events.history import append_to_job
from events.job import JobSubmitted
from events.spec import MAX_SPEC_BYTES, InvalidSpec, JobSpec, parse_spec
from events.store import EventStore
from services.shell.broker import nats_url
from services.tools.cli import EXIT_NOT_FOUND, Command, UserError, add_nats_argument
from services.tools.connect import open_store

log = structlog.get_logger("flightdeck.submit")

EXIT_INVALID = 2  # a spec the user must fix, like an unknown job: nothing was appended
ID_TRIES = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC.toml", help="the job spec (see examples/drill.toml)")
    parser.add_argument("--wait", action="store_true", help="then follow it live until it ends, as `flightdeck "
                        "watch` does (exit 0 only if it completed)")
    add_nats_argument(parser)


def read_spec(path: Path) -> JobSpec:
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1)  # never more: `submit /dev/zero` must not fill memory
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}", EXIT_NOT_FOUND) from None
    try:
        return parse_spec(text)
    except InvalidSpec as exc:
        raise UserError(f"{path}: {exc}", EXIT_INVALID) from None


def new_job_id(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


async def submit(store: EventStore, spec: JobSpec, *, now: float | None = None) -> str:
    """Append JobSubmitted under a job id no history uses yet; returns that id."""
    for _ in range(ID_TRIES):
        job_id = new_job_id(spec.name)
        if await store.last(subjects.CONTROL, subjects.job_all(job_id)) is None:
            break
    else:
        raise UserError(f"no unused job id for {spec.name!r} after {ID_TRIES} tries: is the store full of them?")
    event = JobSubmitted(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=time.time() if now is None else now,
                         producer="cli", spec=spec)
    await append_to_job(store, event)
    log.debug("job submitted", job_id=job_id, slots=spec.slots, priority=spec.priority)
    return job_id


def run(args: argparse.Namespace) -> int:
    spec = read_spec(Path(args.spec))
    url = nats_url(args.nats)

    async def go() -> str:
        async with open_store(url) as store:
            return await submit(store, spec)

    job_id = asyncio.run(go())
    print(job_id, flush=True)
    if args.wait:
        from services.tools.console.watch_cmd import watch  # rich loads only for a watch

        return watch(url, job_id)
    return 0


COMMAND = Command("submit", "submit a job from its TOML spec; prints the job id", add_arguments, run)
