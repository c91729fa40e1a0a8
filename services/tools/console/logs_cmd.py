"""`flightdeck logs JOB [--rank N] [--attempt N] [--follow]`: what the job's ranks printed (stdout and stderr),
from FD_LOGS, on any machine that reaches the broker; `--follow` prints new lines until the job has ended and its
ranks have exited. Lines a rank printed over its rate limit are not there;
a note says how many were left out."""

import argparse
import asyncio
import json
import sys

from flightdeck.events import subjects
from flightdeck.events.logs import RankOutput
from flightdeck.events.store import Stored
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import EXIT_NOT_FOUND, Command, UserError, add_nats_argument
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.console import following
from flightdeck.services.tools.console.events_cmd import until_interrupted
from flightdeck.services.tools.console.following import follow_all, read_all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="the job id (as `flightdeck submit` printed it)")
    parser.add_argument("--rank", type=int, default=None, help="only this rank (default: every rank)")
    parser.add_argument("--attempt", type=int, default=None, help="only this attempt (default: every attempt)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    parser.add_argument("--json", action="store_true", help="one JSON object per line: attempt, rank, line, text")
    add_nats_argument(parser)


def run(args: argparse.Namespace) -> int:
    for name in ("rank", "attempt"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UserError(f"--{name} must be 0 or more, got {getattr(args, name)}", EXIT_NOT_FOUND)
    try:
        chosen = [(subjects.LOGS, [subjects.logs_filter(args.job, args.attempt, args.rank)])]
    except subjects.InvalidSubjectToken as exc:
        raise UserError(str(exc), EXIT_NOT_FOUND) from None
    asyncio.run(_logs(args, nats_url(args.nats), chosen))
    return 0


async def _logs(args: argparse.Namespace, url: str, chosen: list[tuple[str, list[str]]]) -> None:
    async with open_store(url) as store:
        printed = await read_all(store, chosen)
        if not printed and not args.follow:
            known = [s async for batch in store.read(subjects.CONTROL, [subjects.job_all(args.job)]) for s in batch]
            if not known:
                raise UserError(f"no job {args.job!r} on {url}: check the id", EXIT_NOT_FOUND)
            print(f"flightdeck logs: job {args.job} has printed nothing yet" +
                  (" on that rank or attempt" if args.rank is not None or args.attempt is not None else ""),
                  file=sys.stderr)
        for stored in printed:
            show(stored, args.json)
        if args.follow:
            after = {subjects.LOGS: max((s.seq for s in printed), default=0)}
            until = following.ended(store, args.job, exits=True)  # its ranks' last lines are stored by then
            await until_interrupted(follow_all(store, chosen, after, lambda s: show(s, args.json), until))


def show(stored: Stored, as_json: bool) -> None:
    event = stored.event
    if not isinstance(event, RankOutput):
        return
    where = f"[a{event.attempt} r{event.rank}]"
    if event.dropped:
        note = f"... {event.dropped} lines left out: over the rank's output rate limit"
        print(json.dumps({"attempt": event.attempt, "rank": event.rank, "dropped": event.dropped}) if as_json
              else f"{where} {note}")
    for i, text in enumerate(event.lines):
        if as_json:
            print(json.dumps({"attempt": event.attempt, "rank": event.rank, "line": event.first_line + i,
                              "text": text}))
        else:
            print(f"{where} {text}")
    sys.stdout.flush()


COMMAND = Command("logs", "what a job's ranks printed, from any machine (--follow for new lines)", add_arguments, run)
