"""What the health monitor concludes from telemetry; each finding names the inputs it rests on."""

from events.base import JobEvent


class Finding(JobEvent, frozen=True, kw_only=True):
    rank: int
    attempt: int
    evidence: list[str] = []  # ids of the input events that caused this finding


class RankLost(Finding, frozen=True, kw_only=True):
    reason: str  # "heartbeats stopped" or "exited with code N"
    last_seen: float


class RankHung(Finding, frozen=True, kw_only=True):
    step: int
    stalled_s: float
    deadline_s: float


class StragglerDetected(Finding, frozen=True, kw_only=True):
    step_time_s: float
    peer_median_s: float
    factor: float


class NonFiniteLoss(Finding, frozen=True, kw_only=True):
    step: int
    loss: float
    grad_norm: float


class LossSpikeDetected(Finding, frozen=True, kw_only=True):
    step: int
    loss: float
    baseline: float  # median over the window
    mad: float
    z: float
    threshold: float
