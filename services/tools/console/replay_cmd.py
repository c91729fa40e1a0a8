"""`flightdeck replay JOB [--until SEQ|TIME] [--json]`: the job's history folded into its state at a point,
and the timeline of what mattered up to it (phase changes, faults, findings, decisions, checkpoints,
reshards, rollbacks) with times relative to the submission."""

import argparse
import asyncio
import sys

import msgspec

from flightdeck.events import codec
from flightdeck.events.history import HistoryGap, check_contiguous
from flightdeck.services.tools.cli import EXIT_ERROR, Command, UserError
from flightdeck.services.tools.console import status
from flightdeck.services.tools.console.output import relative
from flightdeck.services.tools.history import History, add_history_arguments, history_from_args
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.history.timeline import Entry, job_view_at, timeline
from flightdeck.services.tools.history.until import BadUntil, parse_until, resolve, submitted_at


class Replayed(msgspec.Struct, frozen=True, kw_only=True):
    """What `--json` prints: where the history came from, where it was cut, the state there, the timeline."""

    job_id: str
    source: str
    control_seq: int  # FD_CONTROL folded up to here
    telemetry_seq: int  # FD_TELEMETRY folded up to here
    at: float | None  # the cut's time (None: the whole history)
    offset_s: float | None  # ... as seconds after submission
    state: JobView
    timeline: list[Entry]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_history_arguments(parser)
    parser.add_argument("--until", metavar="SEQ|TIME", default=None,
                        help="stop at this FD_CONTROL sequence, this long after submission (90s, 2m, 1h30m) "
                        "or this ISO time (default: the whole history)")
    parser.add_argument("--json", action="store_true", help="one JSON object: the state and the timeline")


def replayed(history: History, until: str | None) -> Replayed:
    try:
        cut = resolve(history, parse_until(until) if until else None)
    except BadUntil as exc:
        raise UserError(str(exc), EXIT_ERROR) from None
    base = submitted_at(history)
    return Replayed(job_id=history.job_id, source=history.source, control_seq=cut.control_seq,
                    telemetry_seq=cut.telemetry_seq, at=cut.at, offset_s=None if cut.at is None else cut.at - base,
                    state=job_view_at(history, cut), timeline=timeline(history, cut))


def text(r: Replayed) -> str:
    where = "the end" if r.at is None else (f"FD_CONTROL {r.control_seq} "
                                            f"({relative(r.offset_s or 0.0)} after submission)")
    now = r.at if r.at is not None else (r.state.ended_at or r.state.updated_at)
    lines = [f"{r.job_id} from {r.source}, replayed to {where}", "", status.details(r.state, now), "",
             f"timeline ({len(r.timeline)} entries, times after submission):"]
    for e in r.timeline:
        tag = "ctl" if e.stream == "FD_CONTROL" else "tel"
        lines.append(f"  {tag} {e.seq:>6}  {relative(e.offset_s):>10}  {e.kind:<10} {e.type:<20} {e.summary}".rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    history = asyncio.run(history_from_args(args))
    try:
        check_contiguous(history.job_id, history.job_control())
    except HistoryGap as exc:  # what is there still replays; the reader must know it is not all
        print(f"flightdeck replay: warning: {exc}", file=sys.stderr)
    result = replayed(history, args.until)
    if args.json:
        sys.stdout.write(codec.to_json(msgspec.to_builtins(result)).decode() + "\n")  # NaN loss as "nan"
    else:
        print(text(result))
    return 0


COMMAND = Command("replay", "fold a job's history into its state at any point, with the timeline of what "
                  "mattered", add_arguments, run)
