"""`flightdeck export JOB > job.fdh` (or `--out FILE`): the job's history as a self-contained .fdh file,
so a replay or postmortem can run on another machine (`flightdeck import job.fdh` there)."""

import argparse
import asyncio
import sys
from pathlib import Path

from flightdeck.events import subjects
from flightdeck.services.tools.cli import EXIT_ERROR, Command, UserError
from flightdeck.services.tools.history import add_history_arguments, fdh, history_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_history_arguments(parser)
    parser.add_argument("--out", metavar="FILE", default=None, help="write here instead of stdout")


def run(args: argparse.Namespace) -> int:
    if args.out is None and sys.stdout.isatty():
        raise UserError("a history is not for a terminal: redirect it (flightdeck export JOB > job.fdh) or pass "
                        "--out FILE", EXIT_ERROR)
    history = asyncio.run(history_from_args(args, output=True))  # whole: what the ranks printed too
    origin = history.header.source if history.header is not None and history.header.source else history.source
    lines = fdh.dump(history.rows, job_id=history.job_id, source=origin)
    counts = {name: len(history.stream(name)) for name in subjects.HISTORY_STREAMS}
    if args.out is None:
        out = sys.stdout.buffer
        for line in lines:
            out.write(line)
        out.flush()
    else:
        fdh.write(Path(args.out), lines)
    where = "stdout" if args.out is None else args.out
    print(f"exported {history.job_id} to {where}: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
          file=sys.stderr)
    return 0


COMMAND = Command("export", "write a job's history as a self-contained .fdh file (stdout or --out)",
                  add_arguments, run)
