"""Loss spikes as evidence that adds up over steps: no false alarm on a noisy falling curve, none for one loss however
far out, a spike of several steps found once at the step that completes it with its onset and losses as evidence,
kept out of the baseline, the warm-up respected, and an LR rise taken as the schedule's."""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.findings import LossOutlier, LossSpikeDetected
from flightdeck.events.spec import PolicySpec
from flightdeck.events.training import StepCompleted
from flightdeck.services.health.spikes import OUTLIER_Z_FACTOR, Outlier, Spike, SpikeWatch, robust_z, spike_threshold
from tests.unit.health_synth import Cluster, RankPlan, evidence_exists, fold, loss_curve, of

POLICY = PolicySpec()  # spike_z 4, spike_drift 1.5, spike_steps 3, spike_window 50, spike_warmup 20


def noisy_curve(seed: int, steps: int, noise: float, tau: float, *, heavy: bool = False) -> list[float]:
    """A falling loss with relative noise: Gaussian, or heavy-tailed (Student t, 3 degrees of freedom, in log)."""
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        if heavy:
            t = rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3)
            out.append(loss_curve(s, tau=tau) * math.exp(noise * t))
        else:
            out.append(loss_curve(s, tau=tau) * (1 + noise * rng.gauss(0, 1)))
    return out


def watch(losses: list[float], policy: PolicySpec = POLICY, first_step: int = 0,
          lrs: list[float] | None = None) -> tuple[SpikeWatch, list[int]]:
    """The steps spikes were found at (a lone loss far out, an Outlier, is no spike: `outliers` has those)."""
    w, found = observed(losses, policy, first_step, lrs)
    return w, [f.step for f in found if isinstance(f, Spike)]


def observed(losses: list[float], policy: PolicySpec = POLICY, first_step: int = 0,
             lrs: list[float] | None = None) -> tuple[SpikeWatch, list[Spike | Outlier]]:
    w = SpikeWatch(policy.spike_window)
    rates = lrs or [0.0] * len(losses)
    found = [f for i, (x, lr) in enumerate(zip(losses, rates, strict=True))
             if (f := w.observe(first_step + i, x, policy, lr)) is not None]
    return w, found


def outliers(losses: list[float]) -> list[Outlier]:
    return [f for f in observed(losses)[1] if isinstance(f, Outlier)]


# Derandomized so that a rare seed never makes the suite flaky; bench/detectors measures the rates on a corpus.
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(0, 2**32), st.floats(0.001, 0.3), st.floats(50, 2000), st.booleans())
def test_no_false_spike_on_a_noisy_falling_curve(seed: int, noise: float, tau: float, heavy: bool) -> None:
    _, found = watch(noisy_curve(seed, 1500, noise, tau, heavy=heavy))
    assert found == []


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(0, 2**32), st.integers(0, 400), st.floats(2.0, 1000.0), st.integers(1, 2))
def test_a_loss_far_out_for_fewer_steps_than_spike_steps_is_no_spike(seed: int, at: int, factor: float,
                                                                    length: int) -> None:
    """The issue 32 case: one noisy loss x4 over the median rolled a healthy job back. Its harm, if any, shows in
    the losses after it, which then add their own evidence."""
    losses = noisy_curve(seed, 600, 0.01, 300.0)
    for s in range(POLICY.spike_warmup + at, POLICY.spike_warmup + at + length):
        losses[s] *= factor
    assert watch(losses)[1] == []
    # shown instead, once, at its farthest loss: an observation for the user, not an action (issue 53, finding 7)
    (seen,) = outliers(losses)
    assert POLICY.spike_warmup + at <= seen.step < POLICY.spike_warmup + at + length
    assert seen.loss == losses[seen.step]
    assert seen.z >= OUTLIER_Z_FACTOR * POLICY.spike_z and seen.log and seen.baseline < seen.loss / 1.5


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.integers(0, 2**32), st.floats(0.001, 0.3), st.floats(50, 2000))
def test_gaussian_noise_shows_no_outlier(seed: int, noise: float, tau: float) -> None:
    assert outliers(noisy_curve(seed, 1500, noise, tau)) == []


def test_a_spike_is_no_outlier_and_a_rollback_forgets_an_open_excursion() -> None:
    losses = noisy_curve(1, 300, 0.01, 300.0)
    for s in range(100, 106):
        losses[s] *= 5.0
    assert [type(f).__name__ for f in observed(losses)[1]] == ["Spike"]
    # a loss far out, then the run goes back (a rollback) before the excursion ends: that timeline is thrown away
    w = SpikeWatch(POLICY.spike_window)
    for s, x in enumerate(noisy_curve(2, 100, 0.01, 300.0)):
        assert w.observe(s, x, POLICY) is None
    assert w.observe(100, 20.0, POLICY) is None and w.peak is not None
    assert w.observe(90, 1.9, POLICY) is None and w.peak is None


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.integers(0, 2**32), st.floats(0.001, 0.05), st.integers(0, 400), st.integers(3, 8), st.floats(2.0, 10.0))
def test_a_planted_spike_is_found_once_when_its_evidence_adds_up(seed: int, noise: float, at: int, length: int,
                                                                 factor: float) -> None:
    losses = noisy_curve(seed, 600, noise, 300.0)
    start = POLICY.spike_warmup + 30 + at
    for s in range(start, start + length):
        losses[s] *= factor
    w, found = watch(losses)
    assert found == [start + POLICY.spike_steps - 1]  # x2 stands far past spike_z at this noise: 3 steps in full
    assert max(w.window._order) < math.log(min(losses[start:start + length]))  # never in the baseline


def test_spike_reports_its_evidence_and_a_second_episode_is_a_new_finding() -> None:
    losses = noisy_curve(7, 400, 0.01, 300.0)
    for s in (*range(100, 104), *range(300, 303)):
        losses[s] *= 3
    w = SpikeWatch(POLICY.spike_window)
    spikes = [sp for i, x in enumerate(losses) if (sp := w.observe(i, x, POLICY, 0.0, f"s{i}")) is not None]
    assert [(sp.onset, sp.step, sp.episode) for sp in spikes] == [(100, 102, 1), (300, 302, 2)]
    first = spikes[0]
    assert first.losses == tuple(losses[100:103]) and first.ids == ("s100", "s101", "s102")
    assert first.loss == losses[102] and first.log and first.threshold == spike_threshold(POLICY) == 7.5
    assert first.score == 3 * (POLICY.spike_z - POLICY.spike_drift)  # every step counted in full
    assert first.z == robust_z(math.log(first.loss), math.log(first.baseline), first.mad, log=True) > POLICY.spike_z
    assert loss_curve(100) < first.baseline < loss_curve(50) and first.mad > 0  # the window's median lags


def test_a_slow_divergence_is_found_as_its_evidence_adds_up() -> None:
    """x1 to x2 over 20 steps: each step counts in part at first, and the spike's onset is where it left the noise."""
    losses = noisy_curve(3, 400, 0.01, 300.0)
    for i in range(60):
        losses[200 + i] *= 1 + min(1.0, (i + 1) / 20)
    _, found = watch(losses)
    assert len(found) == 1 and 200 < found[0] < 215


@given(st.integers(0, 2**32), st.integers(0, 17))
def test_no_detection_during_warmup(seed: int, at: int) -> None:
    losses = noisy_curve(seed, 60, 0.01, 300.0)
    for s in range(at, at + 3):
        losses[s] *= 5
    _, found = watch(losses, PolicySpec(spike_warmup=20, spike_window=8))
    assert all(s >= 20 for s in found)


def test_warmup_counts_steps_so_a_resumed_job_is_judged_at_once() -> None:
    policy = PolicySpec(spike_warmup=20, spike_window=8)
    losses = [2.0 + 0.01 * math.sin(i) for i in range(12)] + [6.0] * 3
    _, found = watch(losses, policy, first_step=500)
    assert found == [514]


def test_non_finite_losses_are_skipped_and_never_enter_the_baseline() -> None:
    w, found = watch([1.0 + 0.01 * (i % 3) for i in range(30)] + [math.nan, math.inf, 1.01])
    assert found == [] and all(math.isfinite(x) for x in w.window._order)


def test_an_lr_rise_starts_the_baseline_over_and_judging_waits_a_full_window() -> None:
    """A schedule's warm restart: the LR jumps and the loss climbs by a third for a while. Not a spike; a real one
    a full window after it is found against the new baseline."""
    losses = noisy_curve(5, 700, 0.005, 300.0)
    lrs = [1e-3] * 300 + [3e-3] * 400
    for i in range(120):
        losses[300 + i] *= 1 + 0.35 * math.exp(-i / 40) * (1 - math.exp(-i / 5))
    _, found = watch(losses, lrs=lrs)
    assert found == []
    for s in range(500, 505):
        losses[s] *= 3
    _, found = watch(losses, lrs=lrs)
    assert found == [502]
    _, blind = watch(losses[:340], lrs=[1e-3] * 340)  # without the LR in the record the climb is a spike
    assert blind != []


def test_a_loss_that_is_not_positive_is_judged_on_a_linear_scale() -> None:
    losses = [-5.0 + 0.01 * (i % 5) for i in range(100)]
    for s in range(60, 64):
        losses[s] += 2.0
    w, found = watch(losses)
    assert found == [62] and not w.log


def test_spike_through_the_core_is_rank_zeros_with_evidence() -> None:
    c = Cluster(num_ranks=2, policy=PolicySpec(spike_warmup=10))
    c.loss = lambda rank, step: loss_curve(step) * (4.0 if 40 <= step < 44 else 1.0) + 0.01 * math.sin(step * 7 + rank)
    c.start()
    c.run([RankPlan(step_time_s=lambda s: 0.25)] * 2, start=0.0, until=20.0)
    _, found = fold(c.events)
    spikes = of(found, LossSpikeDetected)
    assert len(spikes) == 1 and isinstance(spikes[0], LossSpikeDetected)
    assert (spikes[0].rank, spikes[0].onset, spikes[0].step, spikes[0].attempt) == (0, 40, 42, 0)
    assert len(spikes[0].evidence) == 3 and len(spikes[0].losses) == 3  # the StepCompleted of steps 40, 41, 42
    evidence_exists(found, c.events)
    assert found == spikes


def test_a_lone_bad_batch_through_the_core_is_an_observation_the_views_and_postmortem_show() -> None:
    """Loss 15.1 against ~2.2 at one step, the next back in line (the issue 53 case): no spike and no rollback, one
    LossOutlier naming rank 0's report of that step; `status`, the dashboard's decisions and the postmortem show it."""
    from flightdeck.events.base import JobEvent, RankEvent
    from flightdeck.events.codec import encode
    from flightdeck.events.store import Stored
    from flightdeck.services.tools.console.status import details
    from flightdeck.services.tools.history import jobview
    from flightdeck.services.tools.postmortem.analysis import analyse
    from flightdeck.services.tools.postmortem.describe import describe
    from flightdeck.services.tools.postmortem.report import blocks, markdown
    from tests.unit.helpers import numbered

    c = Cluster(num_ranks=2, policy=PolicySpec(spike_warmup=10))
    c.loss = lambda rank, step: (15.1 if step == 40 else 2.2) + 0.01 * math.sin(step * 7 + rank)
    c.start()
    c.run([RankPlan(step_time_s=lambda s: 0.25)] * 2, start=0.0, until=20.0)
    _, found = fold(c.events)
    assert [type(f).__name__ for f in found] == ["LossOutlier"]
    (seen,) = found
    assert isinstance(seen, LossOutlier) and (seen.rank, seen.step, seen.attempt) == (0, 40, 0)
    assert abs(seen.loss - 15.1) < 0.02 and abs(seen.baseline - 2.2) < 0.02 and seen.log
    evidence_exists(found, c.events)
    (step40,) = [e for e in c.events if isinstance(e, StepCompleted) and e.rank == 0 and e.step == 40]
    assert seen.evidence == [step40.event_id]

    view = jobview.fold(c.job_id, [e for e in c.events if isinstance(e, JobEvent)] + [seen])
    assert view.outliers_seen == 1 and "loss outlier at step 40: 15.1" in view.outliers[0]
    assert "1 lone bad loss (not acted on); newest: loss outlier at step 40" in details(view, now=30.0)
    assert describe(seen).startswith("loss outlier at step 40")  # the dashboard's decisions list says it so
    control = numbered([e for e in c.events if isinstance(e, JobEvent) and not isinstance(e, RankEvent)] + [seen])
    telemetry = [e for e in c.events if isinstance(e, RankEvent)]
    rows = [Stored(stream=stream, subject=f"{prefix}.{c.job_id}.{type(e).__name__}", seq=i + 1, data=encode(e),
                   msg_id=e.event_id, event=e)
            for stream, prefix, events in (("FD_CONTROL", "fd.ctl.job", control), ("FD_TELEMETRY", "fd.tel.job",
                                                                                    telemetry))
            for i, e in enumerate(events)]
    report = markdown(blocks(analyse(rows, c.job_id)))
    assert "## Observations" in report and "loss outlier at step 40" in report
    assert "None: no fault was injected or reported, and no finding was made." in report  # no incident
