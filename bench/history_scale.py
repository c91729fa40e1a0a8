"""`flightdeck verify` and `postmortem` against a job history's length: does their time grow linearly?

Each history is recorded by the real cores (scheduler, resources, health, checkpoints and the node agents' cores)
over the fault explorer's simulated broker and ranks (services/tools/explore), for one fault-free 2-rank job whose
ranks run `--steps-per-turn` steps per simulated 0.1 s (so the history grows without the simulation's per-turn
cost): steps, heartbeat batches, the health monitor's ticks with their telemetry positions, checkpoints every
`--checkpoint-every` steps and their commits. The job's history is then checked as the CLI does it, in process:

    verify      flightdeck.services.tools.audit.verify.verify over the store, the four cores the explorer verifies
    resumed     the same, going on from the mark of a clean verify of the history cut at 90% of its control
                (services/tools/audit/resume.py), over what the CLI reads then: what came after the mark
    postmortem  services.tools.history.read.job_history, then services.tools.postmortem.analysis.analyse

Reported per length: events, seconds and events/s of each, and each length's time over the smallest's, against
the ratio of their lengths (linear growth: equal). Recording is not timed against anything: it is the setup.

    .venv/bin/python bench/history_scale.py                                   # 100k, 1M
    .venv/bin/python bench/history_scale.py --events 100000,1000000,10000000 --out bench/results/cpu-history-scale.json
"""

import argparse
import asyncio
import bisect
import functools
import gc
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.events.store import MemoryStore
from flightdeck.services import registry
from flightdeck.services.tools.audit import cores, resume
from flightdeck.services.tools.audit.verify import verify
from flightdeck.services.tools.explore.invariants import VERIFIED
from flightdeck.services.tools.explore.ranks import Attempt, Ranks
from flightdeck.services.tools.explore.world import POLICY, Plan, World
from flightdeck.services.tools.history.read import job_history
from flightdeck.services.tools.postmortem.analysis import analyse

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-history-scale.json"
EVENTS_PER_STEP = 2.0  # two ranks' StepCompleted, and per 200 steps a few heartbeat batches and ticks: measured


class FastRanks(Ranks):
    """The explorer's ranks, `per_turn` steps at a time."""

    per_turn = 1

    async def advance(self, a: Attempt) -> None:
        for _ in range(self.per_turn):
            before = a.step
            await super().advance(a)
            if a.step == before:  # a boundary that ran no step: a save, a command, the end
                return


async def record(steps: int, per_turn: int, checkpoint_every: int) -> tuple[MemoryStore, str, float]:
    job = JobSpec(name="long", slots=2, policy=POLICY,
                  train=TrainSpec(steps=steps, checkpoint_every=checkpoint_every, data="synthetic"))
    world = World(Plan(seed=1, jobs=[job], faults=[], faults_until=0.0, bound_s=1e9))
    ranks = FastRanks(world.store, world.clock)
    ranks.per_turn = per_turn
    world.ranks = ranks
    for name, shell in world.shells.items():
        if name.startswith("agent-"):
            shell.on_crash = functools.partial(ranks.agent_died, name.removeprefix("agent-"))
    t = time.perf_counter()
    run = await world.run()
    return run.store, run.job_ids[0], time.perf_counter() - t


async def one_length(events: int, per_turn: int, checkpoint_every: int) -> dict[str, Any]:
    store, job_id, record_s = await record(int(events / EVENTS_PER_STEP), per_turn, checkpoint_every)
    control, telemetry = len(store.rows(subjects.CONTROL)), len(store.rows(subjects.TELEMETRY))
    gc.collect()
    services = [registry.build(name, env={}) for name in VERIFIED]
    t, c = time.perf_counter(), time.process_time()
    verdict = await verify(store, job_id, services)
    verify_s, verify_cpu = time.perf_counter() - t, time.process_time() - c
    assert verdict.ok, verdict.divergences[:3]
    resumed = await resumed_verify(store, job_id, verdict.horizon)
    t, c = time.perf_counter(), time.process_time()
    rows, gaps = await job_history(store, job_id)
    pm = analyse(rows, job_id)
    pm_s, pm_cpu = time.perf_counter() - t, time.process_time() - c
    assert not gaps
    n = control + telemetry
    return {"events": n, "control": control, "telemetry": telemetry, "record_s": round(record_s, 1),
            "verify_s": verify_s, "verify_cpu_s": verify_cpu, "verify_events_per_s": n / verify_s,
            "decisions_verified": {ch.service: ch.decisions for ch in verdict.checks},
            "postmortem_s": pm_s, "postmortem_cpu_s": pm_cpu, "postmortem_events_per_s": n / pm_s,
            "goodput": round(pm.goodput.goodput, 4), **resumed,
            "max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def _prefix(store: MemoryStore, control_seq: int) -> MemoryStore:
    """The history as it stood at `control_seq` (telemetry up to the newest tick's position), sharing the rows."""
    control = store.rows(subjects.CONTROL)[:control_seq]
    ticks = [s.event.positions.get(subjects.TELEMETRY, 0) for s in control if isinstance(s.event, ClockTick)]
    cut = MemoryStore()
    cut._streams[subjects.CONTROL] = control  # the bench's shortcut: a slice keeps every row at its sequence
    cut._streams[subjects.TELEMETRY] = store.rows(subjects.TELEMETRY)[:max(ticks, default=0)]
    cut._streams[subjects.DEAD] = store.rows(subjects.DEAD)
    return cut


def _since(store: MemoryStore, control_from: int, telemetry_from: int) -> MemoryStore:
    """What `verify` reads from the broker when it goes on from a mark (job_history(since=...))."""
    view = MemoryStore()
    for stream in (subjects.CONTROL, subjects.TELEMETRY, subjects.DEAD):
        view._streams[stream] = store.rows(stream)
    view.age_out(subjects.CONTROL, control_from - 1)
    view.age_out(subjects.TELEMETRY, telemetry_from - 1)
    return view


def clean_cut(store: MemoryStore, target: int) -> int:
    """The last FD_CONTROL position at or before `target` where every decision of the inputs up to it is stored
    up to it: a verify of the history cut there is clean (a cut while a service had not yet stored what an input
    made it decide would not be, and leaves no mark). A decision of telemetry was made at the tick that folded it."""
    control = store.rows(subjects.CONTROL)
    ticks: dict[str, list[tuple[int, int]]] = {}
    for row in control:
        if isinstance(row.event, ClockTick):
            ticks.setdefault(row.event.service, []).append((row.event.positions.get(subjects.TELEMETRY, 0), row.seq))
    open_at = [0] * (len(control) + 2)
    for row in control:
        producer = row.event.producer if row.event is not None else ""
        where = cores.index_of(row.msg_id, producer) if producer else None
        if where is None:
            continue
        start = where[1]
        if where[0] == subjects.TELEMETRY:
            folded = ticks.get(producer, [])
            i = bisect.bisect_left(folded, (where[1], 0))
            start = folded[i][1] if i < len(folded) else row.seq
        if start < row.seq:
            open_at[start] += 1
            open_at[row.seq] -= 1
    running, best = 0, 0
    for seq in range(1, min(target, len(control)) + 1):
        running += open_at[seq]
        if running == 0:
            best = seq
    return best


async def resumed_verify(store: MemoryStore, job_id: str, horizon: int) -> dict[str, Any]:
    """A clean verify of the history cut at 90% of its control leaves a mark (saved and loaded as the CLI does);
    then the verify of the whole that goes on from it, reading only what came after the mark."""
    cut = clean_cut(store, int(horizon * 0.9))
    services = [registry.build(name, env={}) for name in VERIFIED]
    part = await verify(_prefix(store, cut), job_id, services)
    assert part.ok, part.divergences[:3]
    counts = {c.service: (c.control_inputs, c.telemetry_inputs, c.decisions, c.effects) for c in part.checks}
    with tempfile.TemporaryDirectory(prefix="fd-verify-mark-") as tmp:
        t = time.perf_counter()
        resume.save(Path(tmp), job_id, "bench", part.horizon, part.fleet, part.folders, counts)
        mark = resume.load(Path(tmp), job_id, "bench", services)
        mark_s = time.perf_counter() - t
    assert mark is not None
    view = _since(store, mark.control_from, mark.telemetry_from)
    t, c = time.perf_counter(), time.process_time()
    verdict = await verify(view, job_id, resume=mark)
    took, cpu = time.perf_counter() - t, time.process_time() - c
    assert verdict.ok and verdict.resumed_from == part.horizon, verdict.divergences[:3]
    after = sum(len(view.rows(s)) - (view._first[s] - 1) for s in (subjects.CONTROL, subjects.TELEMETRY))
    return {"resumed_verify_s": took, "resumed_verify_cpu_s": cpu, "resumed_events_after_mark": after,
            "mark_save_load_s": mark_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", default="100000,1000000", help="history lengths, comma-separated")
    p.add_argument("--steps-per-turn", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=2000)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    command = " ".join([".venv/bin/python", *sys.argv])
    results: dict[str, Any] = {"benchmark": "verify and postmortem time against the history's length",
                               "command": command, "lengths": []}
    print(f"command: {command}")
    print(f"{'events':>11} {'record s':>9} {'verify s':>9} {'ev/s':>8} {'x time':>7} {'postmortem s':>12} {'ev/s':>9} "
          f"{'x time':>7} {'x length':>8} {'resumed verify s':>16}")
    for events in (int(e) for e in args.events.split(",")):
        row = asyncio.run(one_length(events, args.steps_per_turn, args.checkpoint_every))
        results["lengths"].append(row)
        base = results["lengths"][0]
        row["verify_time_ratio"] = row["verify_s"] / base["verify_s"]
        row["postmortem_time_ratio"] = row["postmortem_s"] / base["postmortem_s"]
        row["length_ratio"] = row["events"] / base["events"]
        print(f"{row['events']:>11,} {row['record_s']:>9.0f} {row['verify_s']:>9.1f} "
              f"{row['verify_events_per_s']:>8,.0f} {row['verify_time_ratio']:>7.1f} {row['postmortem_s']:>12.1f} "
              f"{row['postmortem_events_per_s']:>9,.0f} "
              f"{row['postmortem_time_ratio']:>7.1f} {row['length_ratio']:>8.1f} {row['resumed_verify_s']:>16.2f}",
              flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
