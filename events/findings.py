"""What the health monitor concludes from telemetry; each finding names the inputs it rests on."""

from typing import Literal

from flightdeck.events.base import JobEvent


class Finding(JobEvent, frozen=True, kw_only=True):
    rank: int
    attempt: int
    evidence: list[str] = []  # ids of the input events that caused this finding


class RankLost(Finding, frozen=True, kw_only=True):
    SCHEMA = 2  # 2 added `never_heard`; a loss without it is still written as version 1

    reason: str  # "heartbeats stopped" or "exited with code N"
    last_seen: float
    # No sign of life since its start: the script never called flightdeck.init() (or was stuck before it).
    never_heard: bool = False


class RankHung(Finding, frozen=True, kw_only=True):
    step: int
    stalled_s: float
    deadline_s: float


class StragglerDetected(Finding, frozen=True, kw_only=True):
    step_time_s: float
    peer_median_s: float
    factor: float


class InexactRestore(Finding, frozen=True, kw_only=True):
    """The attempt's ranks restored a state the uninterrupted run may not equal bitwise from `step` on: `reason`
    is the first rank's (RankStarted.exactness: another layout, extras taken from another rank's copy). One per
    attempt; a job's run is exact until the first of them."""

    step: int
    reason: str


class NonFiniteLoss(Finding, frozen=True, kw_only=True):
    SCHEMA = 2  # 2 let `grad_norm` be None (the script reported none); a finding with one is still version 1

    step: int
    loss: float
    grad_norm: float | None


class LossSpikeDetected(Finding, frozen=True, kw_only=True):
    """Losses above their baseline whose evidence added up (services/health/spikes.py, SpikeWatch): the spike's
    steps are onset..step, its losses `losses`, its StepCompleted ids the evidence."""

    SCHEMA = 2  # 2 added onset, score, losses and log (the evidence adds up over steps; v1 judged one step)

    step: int  # the step whose loss completed the evidence
    loss: float
    baseline: float  # median over the window
    mad: float  # of the window, on the scale judged (log(loss) when `log`)
    z: float  # the robust z of `loss`
    threshold: float  # the score that makes a spike (v1: the z one loss had to pass)
    onset: int = -1  # the excursion's first step (v1: -1, the spike was `step` alone)
    score: float = 0.0  # the evidence summed over onset..step
    losses: list[float] = []  # the excursion's losses, oldest first (the newest 32)
    log: bool = False  # judged on the log scale (v1: never)


class LossOutlier(Finding, frozen=True, kw_only=True):
    """One loss far above its baseline (a robust z of at least twice policy.spike_z) that the losses after it did
    not follow: an excursion that ended without becoming a spike (services/health/spikes.py). Nothing is done about it
    by design (a rollback for one bad batch throws away work and skips good data); it is recorded so a user can
    look at the batch of that step. Rank 0's losses, as for spikes; `evidence` is its StepCompleted."""

    step: int
    loss: float
    baseline: float  # the median loss of the window it was judged against
    z: float  # its robust z (on the log scale when `log`)
    log: bool = False


Verdict = Literal["data", "optimisation", "hardware", "undetermined"]


class SpikeDiagnosed(Finding, frozen=True, kw_only=True):
    """What caused a loss spike, judged after its rollback (services/health/diagnosis.py): `data` when the same
    batches spiked again and skipping them healed it, `optimisation` when it recurred on other batches at the same
    point, `hardware` when training those batches again did not reproduce it (a node to check), `undetermined`
    when the evidence is not enough. `reason` says it in words, with the evidence."""

    finding_id: str  # the LossSpikeDetected it diagnoses
    step: int
    onset: int
    verdict: Verdict
    reason: str
    replayed: bool  # the spike's batches were trained again (policy.spike_diagnosis)
    reproduced: bool  # ... and spiked again
    replay_losses: list[float] = []  # the re-run's losses over onset..step (rank 0)
    replay_s: float = 0.0  # what the re-run cost
    diverged_rank: int = -1  # a rank whose loss left its data-parallel peers' over the spike (-1: none)
    suspect_nodes: list[str] = []  # where a hardware verdict points
    recurred_at: int = -1  # the step of the spike that recurred after the skip (-1: none)


def spike_onset(ev: LossSpikeDetected) -> int:
    """The first step whose loss carried the spike: its recorded onset (v2), or its one step (v1)."""
    return ev.onset if 0 <= ev.onset <= ev.step else ev.step


def nonfinite_summary(ev: NonFiniteLoss) -> str:
    norm = "not reported" if ev.grad_norm is None else ev.grad_norm
    return f"non-finite loss at step {ev.step} on rank {ev.rank} (loss {ev.loss}, grad norm {norm})"


def spike_summary(ev: LossSpikeDetected) -> str:
    """The finding in a line, as the scheduler's reason, `status` and the postmortem say it."""
    if spike_onset(ev) < ev.step:
        return (f"loss spike over steps {ev.onset}-{ev.step}: {ev.loss:.4g} against a median of {ev.baseline:.4g}, "
                f"evidence {ev.score:.1f} >= {ev.threshold:g} (robust z {ev.z:.1f} at the last)")
    return (f"loss spike at step {ev.step}: {ev.loss:.4g} against a median of {ev.baseline:.4g} "
            f"(robust z {ev.z:.1f} > {ev.threshold:g})")


def outlier_summary(ev: LossOutlier) -> str:
    """The observation in a line, as `status`, the postmortem and the dashboard say it."""
    return (f"loss outlier at step {ev.step}: {ev.loss:.4g} against a median of {ev.baseline:.4g} (robust z "
            f"{ev.z:.1f}), and the losses after it back in line: one batch, not acted on; look at the batch of "
            f"step {ev.step}")


def diagnosis_summary(ev: SpikeDiagnosed) -> str:
    """The verdict in a line, as `status`, the postmortem and the dashboard say it."""
    cost = f" (re-run {ev.replay_s:.1f} s)" if ev.replayed else ""
    return f"cause: {ev.verdict}{cost}: {ev.reason}"
