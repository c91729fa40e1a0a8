"""The health core folds a node agent's RankHeartbeats batch as its ranks' own heartbeats: a rank missing from
the batches is lost (the batch that last carried it is the evidence), a rank whose step stops moving while it
beats is hung, and step times carried in the beats feed the straggler watch."""

from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import Finding, RankHung, RankLost, StragglerDetected
from flightdeck.events.heartbeats import RankBeat, RankHeartbeats
from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.core import NAME, core_service
from tests.unit.health_synth import Cluster

SERVICE = core_service()
POLICY = PolicySpec(heartbeat_interval_s=1.0, heartbeat_misses=3, hang_min_s=5.0, hang_factor=2.0,
                    straggler_window=3)


def test_a_batch_folds_like_each_ranks_heartbeats() -> None:
    c = Cluster(num_ranks=4, policy=POLICY)
    c.start()
    state = SERVICE.initial
    found: list[Finding] = []

    def fold(ev: object) -> None:
        nonlocal state
        state, outs = SERVICE.transition(state, ev)  # type: ignore[arg-type]
        found.extend(o.event for o in outs if isinstance(o.event, Finding))  # type: ignore[union-attr]

    for ev in c.events:
        fold(ev)
    batch_ids: dict[int, str] = {}
    for t in range(1, 25):
        beats = []
        for rank in range(4):
            if rank == 2 and t > 5:
                continue  # rank 2 died after t=5
            step = min(t, 6) if rank == 1 else t  # rank 1 stops progressing at step 6 but keeps beating
            beats.append(RankBeat(rank=rank, step=step, occurred_at=t - 0.1,
                                  step_time_s=3.0 if rank == 3 else 1.0))
        batch = RankHeartbeats(job_id=c.job_id, rank=0, attempt=0, node="n1", interval_s=1.0, beats=beats,
                               event_id=f"b{t}", occurred_at=float(t))
        batch_ids[t] = batch.event_id
        fold(batch)
        fold(ClockTick(service=NAME, now=t + 0.5, positions={}, event_id=f"t{t}", occurred_at=t + 0.5))
    by_type = {(type(f).__name__, f.rank) for f in found}
    assert by_type == {("RankLost", 2), ("RankHung", 1), ("StragglerDetected", 3)}, by_type
    lost = next(f for f in found if isinstance(f, RankLost))
    assert lost.last_seen == 4.9 and lost.evidence == [batch_ids[5]] and lost.reason == "heartbeats stopped"
    hung = next(f for f in found if isinstance(f, RankHung))
    assert hung.step == 6
    slow = next(f for f in found if isinstance(f, StragglerDetected))
    assert slow.factor == 3.0 and set(slow.evidence) <= set(batch_ids.values())


def test_beats_of_another_attempt_are_ignored() -> None:
    c = Cluster(num_ranks=2, policy=POLICY)
    c.start()
    state = SERVICE.initial
    for ev in c.events:
        state, _ = SERVICE.transition(state, ev)
    stale = RankHeartbeats(job_id=c.job_id, rank=0, attempt=7, node="n1", interval_s=1.0,
                           beats=[RankBeat(rank=0, step=3, occurred_at=1.0, step_time_s=1.0)],
                           event_id="b", occurred_at=1.0)
    state, _ = SERVICE.transition(state, stale)
    assert state.jobs[c.job_id].ranks[0].seen_id == ""
