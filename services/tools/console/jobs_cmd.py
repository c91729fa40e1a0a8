"""`flightdeck jobs`: the job table, filtered and sorted (`--phase running --name llama --sort age`), or as JSON.
The rows are what `flightdeck status` shows for each job: its history's view (services/tools/history/jobview.py)."""

import argparse
import asyncio
import sys
import time
from typing import Any

from flightdeck.events import codec
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, add_nats_argument
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.console.status import as_json, table
from flightdeck.services.tools.history.jobview import PHASES, JobView

SORTS = {  # newest first for times: the job a person looks for is usually recent
    "submitted": lambda v: -v.submitted_at, "name": lambda v: (v.name, v.job_id),
    "phase": lambda v: (PHASES.index(v.phase), -v.submitted_at), "priority": lambda v: (-v.priority, -v.submitted_at),
    "age": lambda v: v.submitted_at,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--phase", action="append", choices=[*PHASES, "live", "ended"], default=None,
                        help="only jobs in this phase (repeat for several); live: not ended, ended: any end")
    parser.add_argument("--name", default=None, help="only jobs whose name or id contains this")
    parser.add_argument("--sort", choices=sorted(SORTS), default="submitted",
                        help="order: submitted (newest first, the default), age (oldest first), name, phase, priority")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="at most N rows")
    parser.add_argument("--json", action="store_true", help="a JSON list, one object per job (as `status --json`)")
    add_nats_argument(parser)


def chosen(views: list[JobView], phases: list[str] | None, name: str | None) -> list[JobView]:
    """The views a filter keeps: any of `phases` ("live", "ended" stand for groups), and `name` in the name or id."""
    wanted = set(phases or ())

    def phase_ok(v: JobView) -> bool:
        return not wanted or v.phase in wanted or ("ended" in wanted and v.ended) or ("live" in wanted
                                                                                     and not v.ended)
    return [v for v in views if phase_ok(v) and (not name or name in v.name or name in v.job_id)]


def run(args: argparse.Namespace) -> int:
    url = nats_url(args.nats)

    async def go() -> list[JobView]:
        async with await Client.connect(url) as fd:
            return await fd.jobs()

    views = sorted(chosen(asyncio.run(go()), args.phase, args.name), key=SORTS[args.sort])
    views = views[:args.limit] if args.limit is not None else views
    now = time.time()
    if args.json:
        body: list[dict[str, Any]] = [as_json(v, now) for v in views]
        sys.stdout.write(codec.to_json(body).decode() + "\n")
    elif views:
        print(table(views, now))
    else:
        print("no jobs match" if args.phase or args.name else f"no jobs on {url}")
    return 0


COMMAND = Command("jobs", "the job table, filtered by phase and name and sorted", add_arguments, run)
