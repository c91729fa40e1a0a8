"""After a rollback (or a restart from a checkpoint) the loss baseline rewinds to the restored step: the
redone steps, earlier in training, are not spikes against the lower losses that came after them (found by the
loss-spike drill, tests/e2e/test_drills_loss.py, where the redone step 15 read 5.2 against a median of 4.8)."""

from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.spikes import SpikeWatch

POLICY = PolicySpec(spike_window=10, spike_warmup=10)


def loss(step: int) -> float:
    """Falling fast until step 20, then flat, with a little deterministic wiggle: a tiny model's early curve."""
    return 4.8 + 0.08 * max(0, 20 - step) + 0.01 * ((step * 7) % 3 - 1)


def test_redone_steps_after_a_rollback_are_judged_against_the_steps_before_it() -> None:
    w = SpikeWatch(POLICY.spike_window)
    assert [w.observe(s, loss(s), POLICY) for s in range(30)] == [None] * 30
    assert [w.observe(s, loss(s), POLICY) for s in range(15, 40)] == [None] * 25


def test_a_real_spike_after_a_rollback_is_still_found() -> None:
    w = SpikeWatch(POLICY.spike_window)
    for s in range(30):
        w.observe(s, loss(s), POLICY)
    for s in range(15, 35):
        assert w.observe(s, loss(s), POLICY) is None
    spikes = [w.observe(s, loss(s) + 0.8, POLICY) for s in range(35, 38)]
    assert spikes[:2] == [None, None]
    spike = spikes[2]
    assert spike is not None and (spike.onset, spike.step) == (35, 37) and abs(spike.baseline - 4.8) < 0.02


def test_without_the_rewind_the_same_redone_step_would_be_a_spike() -> None:
    """The baseline a redone step 15 would meet without the rewind: steps 20..29 of the old timeline."""
    w = SpikeWatch(POLICY.spike_window)
    for s in range(20, 30):
        w.observe(s + 1000, loss(s), POLICY)  # the same losses, at steps the rewind does not drop
    assert [w.observe(1030 + i, loss(15 + i), POLICY) for i in range(3)][-1] is not None
