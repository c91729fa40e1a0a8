"""The hang and straggler rules on the corpus's recorded step times (every rank of each fault-free run: slow first
steps, checkpoint writes, a loaded 2-core box): their false findings, and their delay on an injected hang or
slow rank.

The hang rule is a deadline, max(policy.hang_min_s, policy.hang_factor x the median of a rank's last 16 step
times), so on a step-time trace its false findings are the steps that took longer than the deadline set by the
steps before them, and its delay on a hang is that deadline. The straggler rule (StragglerWatch) is fed the
ranks' reports in step order; an injected slow rank has its step times multiplied from a step on (as a rank
whose own compute is slow reports them when the trainer times its compute, not its wait in the all-reduce).
"""

import json
import statistics
from collections import deque
from dataclasses import dataclass

from bench.detectors.corpus import CURVES
from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.detectors import HANG_WINDOW, StragglerWatch, hang_deadline


@dataclass(frozen=True)
class Trace:
    name: str
    times: dict[int, tuple[float, ...]]  # rank -> its step times in step order


def traces() -> list[Trace]:
    out = []
    for path in sorted(CURVES.glob("*.json")):
        raw = json.loads(path.read_text())
        out.append(Trace(raw["name"], {int(r): tuple(t) for r, t in raw["step_time_s"].items()}))
    return out


def false_hangs(times: tuple[float, ...], policy: PolicySpec) -> int:
    recent: deque[float] = deque(maxlen=HANG_WINDOW)
    found = 0
    for t in times:
        found += t > hang_deadline(policy, recent)
        if t > 0:
            recent.append(t)
    return found


def stragglers(times: dict[int, tuple[float, ...]], policy: PolicySpec, *, slow_rank: int = -1, from_step: int = 0,
               factor: float = 1.0) -> list[tuple[int, int]]:
    """(rank, step) of every StragglerDetected, the ranks reporting in step order."""
    watch, found = StragglerWatch(), []
    steps = min(len(t) for t in times.values())
    for step in range(steps):
        for rank in sorted(times):
            t = times[rank][step] * (factor if rank == slow_rank and step >= from_step else 1.0)
            if (s := watch.observe(rank, step, t, f"{rank}/{step}", policy)) is not None:
                found.append((s.rank, step))
    return found


def measure(policy: PolicySpec) -> dict[str, object]:
    rows: dict[str, object] = {}
    for tr in traces():
        times = [t for ts in tr.times.values() for t in ts]
        median = statistics.median(times)
        row: dict[str, object] = {
            "ranks": len(tr.times), "median_step_s": round(median, 5),
            "slowest_over_median": round(max(times) / median, 1),
            "false_hangs": sum(false_hangs(ts, policy) for ts in tr.times.values()),
            "false_hangs_without_the_floor": sum(false_hangs(ts, PolicySpec(hang_min_s=1e-9))
                                                 for ts in tr.times.values()),
            "hang_delay_s": round(hang_deadline(policy, deque(tr.times[0][-HANG_WINDOW:])), 1),
        }
        if len(tr.times) > 1:
            row["false_stragglers"] = len(stragglers(tr.times, policy))
            slow = stragglers(tr.times, policy, slow_rank=1, from_step=1000, factor=3.0)
            hits = [step for rank, step in slow if rank == 1 and step >= 1000]
            row["slow_rank_x3_found_after_steps"] = hits[0] - 1000 + 1 if hits else None
        rows[tr.name] = row
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(PolicySpec()), indent=1))
