"""Loss spikes: rank 0's losses judged as evidence that adds up over steps (SpikeWatch), measured by bench/detectors.

Why it works this way: docs/internals.md, "6. The health monitor".
"""

import math
from collections import deque
from dataclasses import dataclass

from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.detectors import EVIDENCE_MAX
from flightdeck.services.health.window import RobustWindow

MAD_SCALE = 1.4826  # MAD x this estimates the standard deviation of normal noise
REL_EPS = 1e-3  # scale floor, relative to the baseline: a rise below spike_z x 0.1% is never a spike
ABS_EPS = 1e-12
MIN_BASELINE = 8  # losses the spike baseline needs before it judges (besides spike_warmup)
LR_RISE = 0.01  # a learning rate this much above every one in the spike baseline starts it over
# A lone loss is shown (Outlier) from this many times spike_z: at spike_z itself, 8 of the 21,000 fault-free steps
# of bench/detectors' recorded curves would be shown, noise; none reached 6
OUTLIER_Z_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class Spike:
    step: int  # the step whose loss completed the evidence
    onset: int  # the first step of the excursion: the spike's losses are those of steps onset..step
    loss: float  # at `step`
    baseline: float  # the window's median loss
    mad: float  # the window's MAD, of log(loss) when `log`
    z: float  # at `step`
    log: bool  # judged on the log scale
    score: float  # the evidence the excursion added up
    threshold: float  # the score that makes a spike
    episode: int
    losses: tuple[float, ...]  # the excursion's losses, oldest first (at most EVIDENCE_MAX, the newest)
    ids: tuple[str, ...]  # the StepCompleted each came in


@dataclass(frozen=True, slots=True)
class Outlier:
    """A loss far out (z at least OUTLIER_Z_FACTOR x spike_z) in an excursion that ended without becoming a spike:
    one bad batch, ignored by design (no rollback), shown so a user can look at it (LossOutlier)."""

    step: int
    loss: float
    baseline: float  # the window's median loss when it came
    z: float
    log: bool
    event_id: str


def robust_z(x: float, median: float, mad: float, *, log: bool = False) -> float:
    """How far `x` stands above the median in robust standard deviations; on the log scale a difference is
    already relative, so the scale's floor is REL_EPS itself."""
    return (x - median) / (MAD_SCALE * mad + (REL_EPS if log else REL_EPS * abs(median)) + ABS_EPS)


def spike_threshold(policy: PolicySpec) -> float:
    return policy.spike_steps * (policy.spike_z - policy.spike_drift)


class SpikeWatch:
    """Loss spikes as evidence that adds up, against the median and MAD of the last `spike_window` losses (a CUSUM
    of robust z-scores, capped per step), on a log scale while every loss is positive.

    Each loss counts by how far its robust z passes `spike_drift`, at most `spike_z - spike_drift`, so no single
    loss, however far out, is a spike: heavy-tailed per-batch noise (small batches, hard examples) makes such
    losses every few hundred steps, and a rollback for one throws away work and skips good data (a lone bad batch
    whose harm does not show in the losses after it needs no rollback either). The count falls back by the same
    rule (a loss below the drift takes off what it lacks) and never below zero; an excursion begins when it leaves
    zero, and is a spike once it reaches `spike_steps` full steps. The log scale makes the rule see a loss that
    doubles alike at any level, and the multiplicative noise of a classifier's loss as symmetric.

    One finding per episode: after a spike, losses stay out of the baseline until one is back within the drift.
    A step at or below one already seen means the run went back (a rollback, or a restart from a checkpoint):
    the losses of those steps belong to a timeline that was thrown away and leave the baseline. A learning rate
    above every one in the baseline (a warm-up, a schedule's restart) starts the baseline over, and judging waits
    for a full window at the new rate: a rise of the loss it causes is the schedule's, not a spike. Non-finite
    losses are NonFiniteLoss's and are skipped. No judgment before step `spike_warmup` or with fewer than
    MIN_BASELINE losses behind it.
    """

    __slots__ = ("episodes", "excursion", "full", "log", "lrs", "onset", "peak", "score", "spiking", "steps",
                 "window")

    def __init__(self, size: int) -> None:
        self.window = RobustWindow(size)  # of losses, on the log scale while `log`
        self.steps: deque[int] = deque()  # the step of each loss in the window, oldest first
        self.lrs: deque[float] = deque()  # the learning rate each was trained at (0: not reported)
        self.log = True  # every loss seen so far was positive
        self.full = False  # judging waits for a full window (after an LR rise)
        self.score = 0.0
        self.onset = -1  # the open excursion's first step
        self.excursion: deque[tuple[float, str]] = deque(maxlen=EVIDENCE_MAX)  # its (loss, event id), newest last
        self.spiking = False  # a spike was found and the loss is not back within the drift yet
        self.episodes = 0  # spikes reported so far: a spike that comes back after a rollback is a new one
        self.peak: Outlier | None = None  # the open excursion's highest loss far enough out to show

    def clone(self) -> "SpikeWatch":
        c = SpikeWatch.__new__(SpikeWatch)
        c.window, c.steps, c.lrs, c.log, c.full = self.window.clone(), self.steps.copy(), self.lrs.copy(), self.log, \
            self.full
        c.score, c.onset, c.excursion = self.score, self.onset, self.excursion.copy()
        c.spiking, c.episodes, c.peak = self.spiking, self.episodes, self.peak
        return c

    def rewind(self) -> None:
        """A new attempt: the loss curve goes on from its restore point, judged afresh (its first loss takes the
        thrown-away steps out of the baseline)."""
        self._calm()
        self.spiking = False

    def _calm(self) -> None:
        self.score, self.onset, self.peak = 0.0, -1, None
        self.excursion.clear()

    def _add(self, step: int, x: float, lr: float) -> None:
        if len(self.window) == self.window.size:
            self.steps.popleft()
            self.lrs.popleft()
        self.steps.append(step)
        self.lrs.append(lr)
        self.window.add(x)

    def _clear(self) -> None:
        while self.steps:
            self.steps.pop()
            self.lrs.pop()
            self.window.pop()

    def observe(self, step: int, loss: float, policy: PolicySpec, lr: float = 0.0, event_id: str = "",
                ) -> Spike | Outlier | None:
        """A spike this loss completes; or, when it ends an excursion that never became one, that excursion's
        highest loss if it was far out (an Outlier: a bad batch the rule lets pass, to be shown)."""
        if not math.isfinite(loss):
            return None
        if not math.isfinite(lr):
            lr = 0.0  # not reported (NaN; 0 in older records)
        window = self.window
        if self.steps and self.steps[-1] >= step:
            while self.steps and self.steps[-1] >= step:
                self.steps.pop()
                self.lrs.pop()
                window.pop()
            self._calm()
            self.spiking = False
        if self.log and loss <= 0:  # not a loss a log suits (a negative objective): judged as it comes from here
            self.log = False
            self._clear()
            self._calm()
        if lr > 0 and self.lrs and lr > max(self.lrs) * (1 + LR_RISE):
            self._clear()
            self._calm()
            self.spiking, self.full = False, True
        x = math.log(loss) if self.log else loss
        if self.full and len(window) >= window.size:
            self.full = False
        ready = len(window) >= (window.size if self.full else min(window.size, MIN_BASELINE))
        if step < policy.spike_warmup or not ready:
            self._add(step, x, lr)
            return None
        median, mad = window.median(), window.mad()
        z = robust_z(x, median, mad, log=self.log)
        if self.spiking:
            if z <= policy.spike_drift:
                self.spiking = False
                self._add(step, x, lr)
            return None
        self.score = max(0.0, self.score + min(z, policy.spike_z) - policy.spike_drift)
        if self.score <= 0.0:
            passed = self.peak
            self._calm()
            self._add(step, x, lr)
            return passed
        if self.onset < 0:
            self.onset = step
        if z >= OUTLIER_Z_FACTOR * policy.spike_z and (self.peak is None or z > self.peak.z):
            self.peak = Outlier(step, loss, math.exp(median) if self.log else median, z, self.log, event_id)
        self.excursion.append((loss, event_id))
        threshold = spike_threshold(policy)
        if self.score < threshold:
            self._add(step, x, lr)
            return None
        baseline = math.exp(median) if self.log else median
        spike = Spike(step, self.onset, loss, baseline, mad, z, self.log, self.score, threshold, self.episodes + 1,
                      tuple(e[0] for e in self.excursion), tuple(e[1] for e in self.excursion if e[1]))
        self._calm()
        self.spiking, self.episodes = True, self.episodes + 1
        return spike
