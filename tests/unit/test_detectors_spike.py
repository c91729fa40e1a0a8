"""Loss spikes against a robust running baseline: no false alarm on a noisy falling curve, no miss on a
planted spike, one finding per episode, the spike kept out of the baseline, the warm-up respected."""

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from events.findings import LossSpikeDetected
from events.spec import PolicySpec
from services.health.detectors import SpikeWatch, robust_z
from tests.unit.health_synth import Cluster, RankPlan, evidence_exists, fold, loss_curve, of

POLICY = PolicySpec()  # spike_z 6, spike_window 50, spike_warmup 20


def noisy_curve(seed: int, steps: int, noise: float, tau: float) -> list[float]:
    """A falling loss with relative Gaussian noise."""
    rng = random.Random(seed)
    return [loss_curve(s, tau=tau) * (1 + noise * rng.gauss(0, 1)) for s in range(steps)]


def watch(losses: list[float], policy: PolicySpec = POLICY, first_step: int = 0) -> tuple[SpikeWatch, list[int]]:
    w = SpikeWatch(policy.spike_window)
    found = [first_step + i for i, x in enumerate(losses) if w.observe(first_step + i, x, policy) is not None]
    return w, found


# Derandomized: with Gaussian noise a 6-sigma false alarm happens about once in a million steps (measured:
# 1 in 1.2M over 2,000 random curves), so fresh random seeds on every run would make this test flaky.
@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(0, 2**32), st.floats(0.001, 0.05), st.floats(50, 2000))
def test_no_false_spike_on_a_noisy_falling_curve(seed: int, noise: float, tau: float) -> None:
    _, found = watch(noisy_curve(seed, 600, noise, tau))
    assert found == []


@settings(max_examples=150, deadline=None, derandomize=True)  # derandomized for the same reason
@given(st.integers(0, 2**32), st.floats(0.001, 0.02), st.integers(0, 400), st.integers(1, 5), st.floats(1.5, 10.0))
def test_a_planted_spike_is_found_once_at_its_first_step(seed: int, noise: float, at: int, length: int,
                                                         factor: float) -> None:
    losses = noisy_curve(seed, 600, noise, 300.0)
    start = POLICY.spike_warmup + at
    for s in range(start, start + length):
        losses[s] *= factor
    w, found = watch(losses)
    assert found == [start]
    assert max(w.window._order) < min(losses[start:start + length])  # the spike never entered the baseline


def test_spike_reports_its_numbers_and_a_second_episode_is_a_new_finding() -> None:
    losses = noisy_curve(7, 300, 0.01, 300.0)
    for s in (100, 101, 102, 200):
        losses[s] *= 3
    w = SpikeWatch(POLICY.spike_window)
    spikes = [sp for i, x in enumerate(losses) if (sp := w.observe(i, x, POLICY)) is not None]
    assert [(sp.step, sp.episode) for sp in spikes] == [(100, 1), (200, 2)]
    first = spikes[0]
    assert first.loss == losses[100] and first.threshold == POLICY.spike_z
    assert first.z == robust_z(first.loss, first.baseline, first.mad) > POLICY.spike_z
    assert loss_curve(100) < first.baseline < loss_curve(50) and first.mad > 0  # the window's median lags


@given(st.integers(0, 2**32), st.integers(0, 19))
def test_no_detection_during_warmup(seed: int, at: int) -> None:
    losses = noisy_curve(seed, 60, 0.01, 300.0)
    losses[at] *= 5
    _, found = watch(losses, PolicySpec(spike_warmup=20, spike_window=8))
    assert all(s >= 20 for s in found)
    assert at not in found


def test_warmup_counts_steps_so_a_resumed_job_is_judged_at_once() -> None:
    policy = PolicySpec(spike_warmup=20, spike_window=8)
    losses = [2.0 + 0.01 * math.sin(i) for i in range(12)] + [6.0]
    _, found = watch(losses, policy, first_step=500)
    assert found == [512]


def test_non_finite_losses_are_skipped_and_never_enter_the_baseline() -> None:
    w, found = watch([1.0 + 0.01 * (i % 3) for i in range(30)] + [math.nan, math.inf, 1.01])
    assert found == [] and all(math.isfinite(x) for x in w.window._order)


def test_spike_through_the_core_is_rank_zeros_with_evidence() -> None:
    c = Cluster(num_ranks=2, policy=PolicySpec(spike_warmup=10))
    c.loss = lambda rank, step: loss_curve(step) * (4.0 if step in (40, 41) else 1.0) + 0.01 * math.sin(step * 7 + rank)
    c.start()
    c.run([RankPlan(step_time_s=lambda s: 0.25)] * 2, start=0.0, until=20.0)
    _, found = fold(c.events)
    spikes = of(found, LossSpikeDetected)
    assert len(spikes) == 1 and isinstance(spikes[0], LossSpikeDetected)
    assert (spikes[0].rank, spikes[0].step, spikes[0].attempt) == (0, 40, 0)
    evidence_exists(found, c.events)
    assert found == spikes
