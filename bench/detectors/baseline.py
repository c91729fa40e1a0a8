"""The baseline: the spike rule Flightdeck shipped until issue 32, kept only to be measured against. One loss whose
robust z against the median and MAD of the last 50 accepted losses passes 6 is a spike (one finding per episode,
a spike kept out of the baseline, no judgment before step 20 or with fewer than 8 losses)."""

import math
from collections import deque

from flightdeck.services.health.spikes import robust_z
from flightdeck.services.health.window import RobustWindow

Z, WINDOW, WARMUP, MIN_BASELINE = 6.0, 50, 20, 8


class SingleStepZ:
    def __init__(self) -> None:
        self.window = RobustWindow(WINDOW)
        self.steps: deque[int] = deque()
        self.spiking = False

    def observe(self, step: int, loss: float, lr: float) -> int | None:
        """The step a finding names, or None."""
        if not math.isfinite(loss):
            return None
        while self.steps and self.steps[-1] >= step:
            self.steps.pop()
            self.window.pop()
        if step >= WARMUP and len(self.window) >= MIN_BASELINE:
            if robust_z(loss, self.window.median(), self.window.mad()) > Z:
                if self.spiking:
                    return None
                self.spiking = True
                return step
        self.spiking = False
        if len(self.window) == self.window.size:
            self.steps.popleft()
        self.steps.append(step)
        self.window.add(loss)
        return None
