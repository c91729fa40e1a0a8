"""`flightdeck events JOB`: a job's control history (and with --telemetry its telemetry), in order;
`--all` for every control event (fleet events included); `--follow` keeps printing new ones: a job's until it has
ended (with its final checkpoint), every job's until Ctrl-C."""

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.store import Stored
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import EXIT_NOT_FOUND, Command, UserError, add_nats_argument
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.console import following, output
from flightdeck.services.tools.console.following import follow_all, read_all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", nargs="?", help="the job id (as `flightdeck submit` printed it)")
    parser.add_argument("--all", action="store_true", help="every control event: all jobs and the fleet")
    parser.add_argument("--clock", action="store_true", help="with --all: include the services' clock ticks")
    parser.add_argument("--telemetry", action="store_true", help="also the job's telemetry (steps, heartbeats)")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep printing new events until the job ends (with --all: until Ctrl-C)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    add_nats_argument(parser)


def run(args: argparse.Namespace) -> int:
    if bool(args.job) == bool(args.all):
        raise UserError("name one job (flightdeck events JOB) or pass --all", EXIT_NOT_FOUND)
    if args.job:
        try:
            subjects.token(args.job)
        except subjects.InvalidSubjectToken as exc:
            raise UserError(str(exc), EXIT_NOT_FOUND) from None
    asyncio.run(_events(args, nats_url(args.nats)))
    return 0


def selection(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(stream, subject filters) to read, control first."""
    if args.all:
        ctl = ["fd.ctl.>"] if args.clock else ["fd.ctl.job.>", "fd.ctl.node.>"]
        return [(subjects.CONTROL, ctl)]
    chosen = [(subjects.CONTROL, [subjects.job_all(args.job)])]
    if args.telemetry:
        chosen.append((subjects.TELEMETRY, [subjects.telemetry_job(args.job)]))
    return chosen


async def _events(args: argparse.Namespace, url: str) -> None:
    async with open_store(url) as store:
        chosen = selection(args)
        history = await read_all(store, chosen)
        if args.job and not any(s.stream == subjects.CONTROL for s in history):
            raise UserError(f"no job {args.job!r} on {url}: check the id (`flightdeck events --all` lists "
                            "every job's events)", EXIT_NOT_FOUND)
        printer = _Printer(args, history[0].event.occurred_at if history and history[0].event else 0.0)
        for stored in history:
            printer.show(stored)
        if args.follow:  # one job's: until it ends
            after = {stream: max((s.seq for s in history if s.stream == stream), default=0) for stream, _ in chosen}
            until = following.ended(store, args.job) if args.job else None
            await until_interrupted(follow_all(store, chosen, after, printer.show, until))


async def until_interrupted(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` until Ctrl-C or SIGTERM, then return normally (following ends only this way). Handlers
    are installed explicitly because a shell starts background jobs with SIGINT ignored."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    else:
        task.result()  # an error while following (e.g. the broker went away for good)


class _Printer:
    def __init__(self, args: argparse.Namespace, base: float) -> None:
        self.json, self.base = args.json, base
        self.show_stream, self.show_job = bool(args.telemetry), bool(args.all)

    def show(self, stored: Stored) -> None:
        if not self.base and stored.event is not None:
            self.base = stored.event.occurred_at
        line = output.json_line(stored) if self.json else output.human_line(
            stored, self.base, show_stream=self.show_stream, show_job=self.show_job)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


COMMAND = Command("events", "print a job's events (or every control event with --all)", add_arguments, run)
