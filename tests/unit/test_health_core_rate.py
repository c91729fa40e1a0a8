"""The health core at scale (4,096 ranks at 1 Hz), pure and in-process: a healthy job folds with no finding.

Its speed (events/s, the cost of a tick, and whether a beat's cost grows with the job) is a figure for
`bench/health_ingest.py`, not an assertion here: a loaded CI box would make it flaky.
"""

import time

from flightdeck.events.clock import ClockTick
from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.core import NAME
from tests.unit.health_synth import SERVICE, Cluster, steady_second

NUM_RANKS = 4096
SECONDS = 6


def test_a_healthy_4096_rank_job_folds_without_a_finding() -> None:
    c = Cluster(num_ranks=NUM_RANKS, policy=PolicySpec(straggler_window=3))
    c.start()
    batches = [steady_second(c.job_id, NUM_RANKS, s) for s in range(SECONDS)]
    ticks = [ClockTick(service=NAME, now=s + 1.0, positions={}, event_id=f"t{s}", occurred_at=s + 1.0)
             for s in range(SECONDS)]
    transition = SERVICE.transition
    state = SERVICE.initial
    for ev in c.events:
        state, _ = transition(state, ev)
    folded = outputs = 0
    tick_s = 0.0
    began = time.perf_counter()
    for batch, tick in zip(batches, ticks, strict=True):
        for ev in batch:
            state, outs = transition(state, ev)
            outputs += len(outs)
        t0 = time.perf_counter()
        state, outs = transition(state, tick)
        outputs += len(outs)
        tick_s = max(tick_s, time.perf_counter() - t0)
        folded += len(batch) + 1
    elapsed = time.perf_counter() - began
    print(f"\nhealth core: {folded} events ({NUM_RANKS} ranks x {SECONDS} s, heartbeat + step each) in "
          f"{elapsed:.2f} s = {folded / elapsed:,.0f} events/s; slowest tick {tick_s * 1e3:.1f} ms; {outputs} findings")
    assert folded == SECONDS * (2 * NUM_RANKS + 1)
    assert outputs == 0  # a healthy job: nothing to report
