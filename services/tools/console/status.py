"""`flightdeck status [JOB]`: every job as a table, or one job in detail (`--json` for scripts).

What a job's status is comes from its control history alone (jobview.py), plus the newest step its ranks
reported on telemetry, as the client reads them (services/tools/client.py, which `cancel` and `checkpoints` use too).
"""

import argparse
import asyncio
import sys
import time
from typing import Any

import msgspec

from flightdeck.events import codec
from flightdeck.events.plan import coordinates, described
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import Command, add_nats_argument
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.history.reasons import headline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", nargs="?", help="one job's details (default: a table of every job)")
    parser.add_argument("--json", action="store_true", help="JSON: one object for a job, a list for the table")
    add_nats_argument(parser)


def duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02}m"
    return f"{s // 86400}d{s % 86400 // 3600:02}h"


def _slots(v: JobView) -> str:
    return f"{v.world_size or '-'}/{v.slots}"


def _steps(v: JobView) -> str:
    return f"{'-' if v.steps_done is None else v.steps_done}/{v.steps}"


def _checkpoint(v: JobView) -> str:
    last = v.last_checkpoint
    return f"step {last.step}" if last else "-"


COLUMNS = ("JOB", "PHASE", "PRIO", "SLOTS", "STEPS", "CHECKPOINT", "RESTARTS", "AGE")


RANKS_SHOWN = 16


def _ranks(v: JobView) -> str:
    """Which node each rank runs on, with its place in the planned mesh when the layout is more than DP."""
    plan = v.plan if v.plan and v.plan.world_size == len(v.placement) and v.plan.tp * v.plan.pp > 1 else None
    shown = [f"{ref.rank} on {ref.node}" + (" (" + ", ".join(f"{dim} {at}" for dim, at in coordinates(
        plan, ref.rank).items()) + ")" if plan else "") for ref in v.placement[:RANKS_SHOWN]]
    more = len(v.placement) - RANKS_SHOWN
    return "; ".join(shown) + (f"; {more} more (status --json)" if more > 0 else "")


def table(views: list[JobView], now: float) -> str:
    rows = [COLUMNS] + [(v.job_id, v.phase, str(v.priority), _slots(v), _steps(v), _checkpoint(v), str(v.restarts),
                         duration(now - v.submitted_at)) for v in views]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    right = {2, 6}  # numbers line up on the right
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip() for r in rows)


def details(v: JobView, now: float) -> str:
    last = v.last_checkpoint
    deleted = sum(c.deleted for c in v.checkpoints)
    lines = [
        ("job", f"{v.job_id} ({v.name})"),
        ("phase", v.phase + (f" ({headline(v.reason)})" if v.reason else "")),
        *([("paused", v.paused)] if v.paused and not v.ended else []),  # in full: it may say what to do
        ("priority", str(v.priority)),
        ("slots", f"{v.slots} asked, {v.world_size} granted (attempt {v.attempt})"),
        *([("layout", described(v.plan))] if v.plan else []),
        *([("ranks", _ranks(v))] if v.placement and not v.ended else []),
        ("steps", f"{_steps(v)} done" + ("" if v.loss is None else f" (loss {v.loss:.4g})")),
        *([("metrics", ", ".join(f"{k} {x:.4g}" for k, x in sorted(v.metrics.items())))] if v.metrics else []),
        ("checkpoint", f"{last.checkpoint_id} at step {last.step}" if last else "none committed"),
        ("committed", f"{len(v.checkpoints)} ({deleted} deleted)"
         + (f", {v.checkpoint_failures} failed" if v.checkpoint_failures else "")),
        *([("store", f"REFUSING this job's checkpoints: {v.store_failing}")] if v.store_failing else []),
        *([("final state", f"NOT SAVED: {v.final_unsaved}")] if v.final_unsaved else []),
        ("restarts", f"{v.restarts} of {v.max_restarts}"
         + (f", resumed from step {v.resumed_from_step}" if v.resumed_from_step is not None else "")),
        ("rollbacks", str(v.rollbacks)),
        *([("spike", v.spike_cause)] if v.spike_cause else []),
        ("exactness", v.inexact or "exact: no restore parted it from the uninterrupted run"),
        *([("outliers", f"{v.outliers_seen} lone bad loss{'es' if v.outliers_seen > 1 else ''} (not acted on); "
            f"newest: {v.outliers[-1]}")] if v.outliers else []),
        *([("last fault", headline(v.last_fault))] if v.last_fault else []),
        ("submitted", f"{duration(now - v.submitted_at)} ago"),
    ]
    if v.preempted_by:
        lines.append(("preempted by", v.preempted_by))
    if v.running_since and not v.ended:
        lines.append(("running for", duration(now - v.running_since)))
    if v.ended:
        lines.append(("ended", f"{duration(now - v.ended_at)} ago, after {duration(v.ended_at - v.submitted_at)}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k + ':':<{width + 1}} {val}" for k, val in lines)


def as_json(v: JobView, now: float) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(v)
    for internal in ("granted", "started"):
        out.pop(internal)
    last = v.last_checkpoint
    out["steps_done"] = v.steps_done
    out["last_checkpoint"] = msgspec.to_builtins(last) if last else None
    out["age_s"] = round(now - v.submitted_at, 3)
    return out


def run(args: argparse.Namespace) -> int:
    url = nats_url(args.nats)

    async def go() -> JobView | list[JobView]:
        async with open_store(url) as store:
            fd = Client(store, url)
            return await fd.status(args.job) if args.job else await fd.jobs()

    found = asyncio.run(go())
    now = time.time()
    if args.json:
        body: Any = as_json(found, now) if isinstance(found, JobView) else [as_json(v, now) for v in found]
        sys.stdout.write(codec.to_json(body).decode() + "\n")  # NaN loss as "nan", not null
    elif isinstance(found, JobView):
        print(details(found, now))
    elif found:
        print(table(found, now))
    else:
        print(f"no jobs on {url}: `flightdeck submit SPEC.toml` submits one")
    return 0


COMMAND = Command("status", "every job's phase and progress, or one job's details", add_arguments, run)
