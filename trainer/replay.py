"""A rollback's diagnostic re-run (RollbackRequested.replay): the spike's batches trained again from the
checkpoint, their losses kept for SpikeReplayed, before the checkpoint is restored again and the skip applied."""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from flightdeck.events.commands import RollbackRequested


@dataclass(slots=True)
class Replay:
    cmd: RollbackRequested
    path: Path  # the loaded checkpoint, loaded again at the end
    timeline: int
    start: int  # the checkpoint's step: the re-run's first
    until: int  # the step the rank had reached when told to roll back: the re-run stops there
    started: float  # perf_counter at the command
    seen: dict[int, float] = field(default_factory=dict)

    def record(self, step: int, loss: float) -> None:
        self.seen[step] = loss

    def losses(self) -> list[float]:
        """Steps start..until-1, oldest first; NaN where the script reported none."""
        return [self.seen.get(step, math.nan) for step in range(self.start, self.until)]

    def seconds(self) -> float:
        return round(time.perf_counter() - self.started, 3)
