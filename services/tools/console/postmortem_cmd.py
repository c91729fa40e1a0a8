"""`flightdeck postmortem JOB --out DIR [--from FILE]`: a report of what happened to a job (report.md with PNG
plots, and a self-contained report.html), from an imported history, the live broker, or a history file."""

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from flightdeck.services.tools.cli import EXIT_NOT_FOUND, Command, UserError, add_json_argument, print_json
from flightdeck.services.tools.history import add_history_arguments, history_from_args

if TYPE_CHECKING:
    from flightdeck.services.tools.postmortem import Postmortem

INCIDENT_LINES = 3  # the summary names this many incidents; the report has them all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_history_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="folder for report.md, report.html and the plots (created if missing)")
    add_json_argument(parser, "the report's files and its figures (outcome, goodput, incidents)")


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file; name a folder for the report")
    # numpy and matplotlib load here, not when the CLI starts: every other verb would pay for them
    from flightdeck.services.tools.postmortem import analyse, write_report

    history = asyncio.run(history_from_args(args))
    try:
        pm = analyse(history.rows, history.job_id)
    except LookupError as exc:
        raise UserError(f"{history.source}: {exc}", EXIT_NOT_FOUND) from None
    try:
        paths = write_report(pm, args.out)
    except OSError as exc:
        raise UserError(f"cannot write the report into {args.out}: {exc.strerror or exc}") from None
    if args.json:
        print_json(as_json(pm, history.source, {name: str(p) for name, p in paths.items()},
                           [str(gap) for gap in history.gaps]))
        return 0
    print(f"postmortem of {history.job_id} ({history.source}):")
    print(f"  {paths['report.html']}  (open in a browser; {paths['report.md'].name} and the PNGs beside it)")
    for line in summary(pm):
        print(f"  {line}")
    for gap in history.gaps:  # figures over a history with holes: say where they are
        print(f"  missing from the history: {gap}")
    return 0


def as_json(pm: "Postmortem", source: str, files: dict[str, str], gaps: list[str]) -> dict[str, object]:
    s, g = pm.summary, pm.goodput
    return {"job_id": s.job_id, "source": source, "files": files, "outcome": s.outcome, "reason": s.reason,
            "wall_s": s.wall_s, "steps_final": s.steps_final, "steps_computed": s.steps_computed,
            "goodput": g.goodput, "parts_s": g.parts, "missing": gaps,
            "incidents": [{"number": i.number, "kind": i.kind, "attempt": i.attempt, "decision": i.decision,
                           "detect_s": i.time_to_detect, "recover_s": i.time_to_recover, "steps_lost": i.steps_lost,
                           "steps_redone": i.steps_redone, "diagnosis": i.diagnosis} for i in pm.incidents]}


def summary(pm: "Postmortem") -> list[str]:
    """Five to ten lines: outcome, time, steps, goodput, the biggest badput parts, the first incidents."""
    from flightdeck.services.tools.postmortem.goodput import BADPUT
    from flightdeck.services.tools.postmortem.report import seconds

    s, g = pm.summary, pm.goodput
    lines = [f"outcome: {s.outcome}" + (f" ({s.reason})" if s.reason else ""),
             f"wall time {seconds(s.wall_s)}; {s.steps_final} of {s.steps_planned} steps stand, "
             f"{s.steps_computed - s.steps_final} were thrown away and redone",
             f"goodput {g.goodput:.1%}; badput: " + ", ".join(
                 f"{p} {seconds(g.parts[p])}" for p in sorted(BADPUT, key=lambda p: -g.parts[p])[:4]
                 if g.parts[p] > 0),
             f"incidents: {len(pm.incidents)}"]
    for i in pm.incidents[:INCIDENT_LINES]:
        recover = f", recovered in {seconds(i.time_to_recover)}" if i.time_to_recover is not None else ""
        lines.append(f"  #{i.number} {i.kind} (attempt {i.attempt}): {i.decision}; detected in "
                     f"{seconds(i.time_to_detect)}{recover}; {i.steps_lost} steps lost")
        if i.diagnosis:
            lines.append(f"     {i.diagnosis}")
    if len(pm.incidents) > INCIDENT_LINES:
        lines.append(f"  ... and {len(pm.incidents) - INCIDENT_LINES} more in the report")
    return lines


COMMAND = Command("postmortem", "write a report of what happened to a job (Markdown, HTML, plots)",
                  add_arguments, run)
