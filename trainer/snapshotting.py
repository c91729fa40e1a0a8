"""When a rank takes its host snapshots (trainer/snapshots.py), for the step loop (trainer/session.py): at the
multiples of `train.snapshot_every` steps, spaced further out (a whole multiple, the same on every rank: agreed at
the boundary) while one costs more than `train.snapshot_max_overhead` of the steps between two, and what turns them
off (a node short of shared memory, a write that failed): said once."""

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from flightdeck.events.checkpoint import DataPosition
from flightdeck.trainer import checkpointing
from flightdeck.trainer.snapshots import Snapshots, SnapshotsOff

log = structlog.get_logger("trainer")
MAX_SPACING = 1 << 20  # snapshots so costly that none would fit: one in a million steps


def spare_core() -> bool:
    """Whether a core is idle beyond torch's threads here and whatever else the machine runs (its load average):
    the CPU a snapshot takes beside training (its copy's threads, its checksums) then costs training nothing, and
    only its hold of the training thread counts. On a busy machine (a CI box running several jobs' ranks) it counts:
    counted as free there, snapshots every step slowed the ranks' checkpoint writes enough to call them hung."""
    cores = len(os.sched_getaffinity(0))
    return cores - max(os.getloadavg()[0], torch.get_num_threads()) >= 1.0


class Cadence:
    def __init__(self, snaps: Snapshots, *, every: int, max_overhead: float, off: Callable[[str], None]) -> None:
        self.snaps: Snapshots | None = snaps
        self.every, self.max_overhead, self.off = every, max_overhead, off
        self.snapped_at: int | None = None
        self.spacing_now = 1  # the ranks' agreed spacing, in multiples of `every` (spacing, agreed)
        self.spare_cores: Callable[[], bool] = spare_core
        self.gather_s = 0.0  # gathering the state's items (get_state_dict): part of a snapshot's cost
        self.gather_total_s = 0.0
        self._sharded: tuple[int | None, bool] = (None, False)  # (generation, whether it holds DTensors)
        self.holding_s = 0.0  # a step's hold of its boundary for a snapshot after a failure (trainer/lastboundary.py)

    def spacing(self, step_times: list[float]) -> int:
        """How many times `every` steps apart this rank's snapshots must be to keep within their share of the
        training time, by what its last one cost. The ranks agree on the largest at each boundary (`agreed`): they
        then snapshot the same steps, so a failed attempt's slots form a set at a step every rank holds."""
        if self.snaps is None or self.max_overhead >= 1.0:
            return 1
        beside = 0.0 if self.spare_cores() else self.snaps.last_background_s
        cost, times = self.snaps.last_stall_s + self.gather_s + beside, step_times[-5:]
        if cost <= 0 or not times:
            return 1
        share = (statistics.median(times) * self.max_overhead - self.holding_s) * self.every  # the holds' share first
        return MAX_SPACING if share <= 0 else min(MAX_SPACING, max(1, math.ceil(cost / share)))

    def agreed(self, spacing: int) -> None:
        self.spacing_now = max(1, spacing)

    def due(self, step: int) -> bool:
        return self.snaps is not None and step % (self.every * self.spacing_now) == 0 and self.snapped_at != step

    def take(self, step: int, live: Callable[[], dict[str, Any]], position: DataPosition, world_size: int, *,
             timeline: int, checkpointing_: bool, layout: tuple[int, int, int],
             settled: Callable[[dict[str, Any]], frozenset[str]] = lambda items: frozenset(),
             generation: Callable[[], int | None] = lambda: None) -> None:
        """Snapshot the state `live()` gathers (call only when `due`); `settled(items)`: those only the optimizer's
        step writes, copied beside training (Snapshots.take); `generation()`: which tensors over which memory that
        gather found (TrainState.generation; None: not known), so a snapshot of the same keeps its layout and plan."""
        assert self.snaps is not None
        started = time.perf_counter()
        items = live()
        items[checkpointing.META_KEY] = checkpointing.meta_item(step, position, world_size, layout)
        gen = generation()
        if gen is None or self._sharded[0] != gen:  # the same tensors as the last gather's: as sharded as they were
            self._sharded = (gen, checkpointing.has_dtensors(items))
        replicated = layout[1] * layout[2] == 1 and not self._sharded[1]  # (dp, tp, pp)
        self.gather_s = time.perf_counter() - started
        self.gather_total_s += self.gather_s
        try:
            self.snaps.take(step, items, position, timeline=timeline, checkpointing=checkpointing_,
                            replicated=replicated, layout=layout, settled=settled(items), generation=gen)
        except SnapshotsOff as exc:
            self._off(str(exc))
            return
        self.snapped_at = step

    def copied(self) -> None:
        """Before anything writes the state: the snapshot's copy beside training is done."""
        if self.snaps is not None:
            self.snaps.copied()

    def written(self) -> None:
        """Return once the newest snapshot's header is written (a failure to write it turns snapshots off)."""
        self._or_off(Snapshots.wait)

    def close(self) -> None:
        self._or_off(Snapshots.close)

    def _or_off(self, act: Callable[[Snapshots], None]) -> None:
        if self.snaps is None:
            return
        try:
            act(self.snaps)
        except SnapshotsOff as exc:
            self._off(str(exc))

    def _off(self, reason: str) -> None:
        log.warning("host snapshots off", reason=reason)
        self.snaps = None
        self.off(reason)
