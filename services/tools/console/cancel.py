"""`flightdeck cancel JOB`: append CancelRequested to the job's history; the scheduler stops the ranks and
records JobCancelled. A job that has already ended is left as it is (exit 0, saying how it ended)."""

import argparse
import asyncio

from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, add_json_argument, add_nats_argument, print_json
from flightdeck.services.tools.client import Client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="the job id (as `flightdeck submit` printed it)")
    parser.add_argument("--reason", default="", help="why, for the record (default: cancelled by the user)")
    add_json_argument(parser, "what happened (job_id, phase, outcome: requested, already requested, ended)")
    add_nats_argument(parser)


async def cancel(url: str, job_id: str, reason: str) -> tuple[str, str, str]:
    """(outcome, phase, what happened in one line for the user)."""
    async with await Client.connect(url) as fd:
        view = await fd.cancel(job_id, reason)
    if view.ended:
        return "ended", view.phase, f"{job_id} has already ended ({view.phase}): nothing to cancel"
    if view.cancel_requested:
        return "already requested", view.phase, f"{job_id}: a cancel is already requested (phase {view.phase})"
    return "requested", view.phase, (f"{job_id}: cancel requested (phase {view.phase}); `flightdeck status "
                                     f"{job_id}` shows when it has ended")


def run(args: argparse.Namespace) -> int:
    outcome, phase, said = asyncio.run(cancel(nats_url(args.nats), args.job, args.reason))
    if args.json:
        print_json({"job_id": args.job, "phase": phase, "outcome": outcome})
    else:
        print(said)
    return 0


COMMAND = Command("cancel", "cancel a job: its ranks are stopped and it ends as cancelled", add_arguments, run)
