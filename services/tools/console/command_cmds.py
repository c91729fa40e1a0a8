"""`flightdeck pause|resume|checkpoint JOB`: a person's commands to a running job's ranks, appended to its history
(the ranks obey them at their next step boundary, all at the same step). A job that is not running is told so and
nothing is appended: only running ranks read commands."""

import argparse
import asyncio
import time
import uuid
from collections.abc import Callable

from events.commands import CheckpointRequested, PauseRequested, ResumeRequested
from events.history import append_to_job
from services.shell.broker import nats_url
from services.tools.cli import EXIT_ERROR, Command, UserError, add_nats_argument
from services.tools.connect import open_store
from services.tools.console.status import load_view

Make = Callable[[str, str], CheckpointRequested | PauseRequested | ResumeRequested]


def _pause(job_id: str, reason: str) -> PauseRequested:
    return PauseRequested(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=time.time(), producer="cli",
                          reason=reason)


def _resume(job_id: str, reason: str) -> ResumeRequested:
    return ResumeRequested(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=time.time(), producer="cli",
                           reason=reason)


def _checkpoint(job_id: str, reason: str) -> CheckpointRequested:
    return CheckpointRequested(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=time.time(), producer="cli",
                               reason=reason)


async def send(url: str, job_id: str, make: Make, reason: str) -> str:
    async with open_store(url) as store:
        view = await load_view(store, job_id, url)
        if view.phase != "running":
            raise UserError(f"{job_id} is {view.phase}: only a running job's ranks take commands; nothing sent",
                            EXIT_ERROR)
        command = make(job_id, reason)
        await append_to_job(store, command)
    return f"{job_id}: {type(command).__name__} sent; its ranks obey it at their next step boundary"


def _command(name: str, make: Make, help: str) -> Command:
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("job", help="the job id (as `flightdeck submit` printed it)")
        parser.add_argument("--reason", default="", help="why, for the record")
        add_nats_argument(parser)

    def run(args: argparse.Namespace) -> int:
        print(asyncio.run(send(nats_url(args.nats), args.job, make, args.reason or f"{name} by the user")))
        return 0

    return Command(name, help, add_arguments, run)


PAUSE = _command("pause", _pause, "pause a running job: its ranks stop stepping (hang detection pauses too)")
RESUME = _command("resume", _resume, "resume a paused job")
CHECKPOINT = _command("checkpoint", _checkpoint, "checkpoint a running job now, beside its checkpoint_every")
