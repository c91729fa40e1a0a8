"""The spike diagnosis's rules (services/health/diagnosis.py), as pure functions of the events a job's history
holds: each verdict from the evidence that makes it, once per incident, and never before the skip is in force."""

import math

from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, SpikeDiagnosed
from flightdeck.events.training import RolledBack, SpikeReplayed
from flightdeck.services.health.diagnosis import Diagnoses, divergence, reproduced

JOB = "j-000001"
NODES = {0: "n1", 1: "n2"}


def spike(step: int = 32, onset: int = 30, eid: str = "health:FD_TELEMETRY:9:0",
          loss: float = 40.0) -> LossSpikeDetected:
    return LossSpikeDetected(job_id=JOB, rank=0, attempt=0, step=step, onset=onset, loss=loss, baseline=4.0, mad=0.01,
                             z=9.0, threshold=7.5, score=7.5, losses=[loss] * (step - onset + 1), log=True,
                             event_id=eid)


def rollback(trigger: str, replay: bool = True, cid: str = "step000000025-a0") -> RollbackRequested:
    return RollbackRequested(job_id=JOB, checkpoint_id=cid, to_step=25, skip_from=30, skip_to=33, reason="spike",
                             trigger_id=trigger, replay=replay, event_id="scheduler:FD_CONTROL:10:0")


def replayed(losses: list[float], cid: str = "step000000025-a0", rank: int = 0) -> SpikeReplayed:
    return SpikeReplayed(job_id=JOB, rank=rank, checkpoint_id=cid, from_step=25, losses=losses, seconds=1.5,
                         event_id=f"trainer:replay:{rank}")


def landed(cid: str = "step000000025-a0") -> RolledBack:
    return RolledBack(job_id=JOB, rank=0, checkpoint_id=cid, to_step=25, skip_from=30, skip_to=33)


def window(rank0: float, rank1: float) -> dict[int, dict[int, float]]:
    return {0: {s: rank0 for s in (30, 31, 32)}, 1: {s: rank1 for s in (30, 31, 32)}}


def opened(w: dict[int, dict[int, float]] | None = None, margin: int = 5) -> tuple[Diagnoses, LossSpikeDetected]:
    d, s = Diagnoses(margin=margin), spike()
    assert d.spike(s, NODES, w if w is not None else window(40.0, 41.0)) is None
    d.rollback(rollback(s.event_id))
    return d, s


def settled(out: SpikeDiagnosed | None) -> SpikeDiagnosed:
    assert out is not None
    return out


def test_the_same_batches_spiking_again_and_the_skip_healing_it_is_data() -> None:
    d, s = opened()
    assert d.replayed(replayed([4.1] * 5 + [40.0, 39.0, 41.0])) is None  # reproduced: wait for the skip to tell
    d.landed(landed())
    assert [d.stepped(step) for step in range(25, 38)] == [None] * 13  # through the horizon (32 + 5)
    v = settled(d.stepped(38))
    assert (v.verdict, v.finding_id, v.replayed, v.reproduced, v.recurred_at) == ("data", s.event_id, True, True, -1)
    assert v.replay_losses == [40.0, 39.0, 41.0] and v.replay_s == 1.5
    assert v.evidence == [s.event_id, "scheduler:FD_CONTROL:10:0", "trainer:replay:0"]
    assert "batches [30, 33)" in v.reason and "none through step 38" in v.reason
    assert d.stepped(39) is None and d.open is None  # judged once


def test_a_spike_back_at_the_same_point_after_the_skip_is_optimisation_and_the_incident_is_judged_once() -> None:
    d, s = opened()
    d.replayed(replayed([4.1] * 5 + [40.0, 39.0, 41.0]))
    d.landed(landed())
    again = spike(step=34, onset=31, eid="health:FD_TELEMETRY:20:0")
    v = settled(d.spike(again, NODES, window(40.0, 40.0)))
    assert (v.verdict, v.finding_id, v.recurred_at) == ("optimisation", s.event_id, 34)
    assert again.event_id in v.evidence and "train.lr" in v.reason
    assert d.spike(spike(step=36, onset=35, eid="health:FD_TELEMETRY:30:0"), NODES, {}) is None  # its third spike
    assert d.open is None


def test_a_spike_seen_again_before_the_skip_is_in_force_is_the_same_excursion() -> None:
    d, s = opened()
    assert d.spike(spike(step=35, onset=33, eid="health:FD_TELEMETRY:12:0"), NODES, {}) is None
    assert d.open is not None and d.open.finding == s


def test_a_rerun_that_does_not_spike_is_hardware_on_the_node_of_the_rank_that_left_its_peers() -> None:
    d, _ = opened(window(40.0, 4.2))
    v = settled(d.replayed(replayed([4.1] * 8)))  # judged at once: nothing later can make it data or optimisation
    assert (v.verdict, v.replayed, v.reproduced, v.diverged_rank, v.suspect_nodes) == ("hardware", True, False, 0,
                                                                                      ["n1"])
    assert "n1" in v.reason and "self-check" in v.reason


def test_without_a_rank_that_left_its_peers_hardware_points_at_every_node_of_the_job() -> None:
    d, _ = opened(window(40.0, 41.0))
    v = settled(d.replayed(replayed([4.1] * 8)))
    assert (v.verdict, v.diverged_rank, v.suspect_nodes) == ("hardware", -1, ["n1", "n2"])


def test_without_a_rerun_a_healed_spike_is_undetermined_and_says_why() -> None:
    d, s = Diagnoses(margin=5), spike()
    d.spike(s, NODES, window(40.0, 41.0))
    d.rollback(rollback(s.event_id, replay=False))
    assert d.replayed(replayed([4.1] * 8)) is None  # not asked for: another rollback's, ignored
    d.landed(landed())
    v = settled(d.stepped(40))
    assert (v.verdict, v.replayed) == ("undetermined", False)
    assert "policy.spike_diagnosis is off" in v.reason


def test_a_rerun_cut_short_by_a_restart_is_not_waited_for() -> None:
    d, _ = opened()
    d.restarted()  # the restart restores with the skip in force; the re-run died with the attempt
    v = settled(d.stepped(40))
    assert v.verdict == "undetermined" and "did not finish" in v.reason


def test_a_job_that_ends_first_gets_the_verdict_its_evidence_allows() -> None:
    d, _ = opened()
    d.replayed(replayed([4.1] * 5 + [40.0, 39.0, 41.0]))
    v = settled(d.ended())
    assert v.verdict == "undetermined" and "data or the optimisation" in v.reason


def test_reproduction_is_most_of_the_spike_s_height_on_the_log_scale() -> None:
    s = spike(loss=40.0)  # 10x a baseline of 4
    assert reproduced(s, [4.0, 13.0])  # 13/4 = 3.25x >= 10 ** 0.5
    assert not reproduced(s, [4.0, 12.0])
    assert reproduced(s, [4.0, math.inf])  # blew up again
    assert not reproduced(s, [math.nan, math.nan])  # nothing reported


def test_divergence_needs_one_rank_alone_at_twice_its_peers() -> None:
    assert divergence(window(40.0, 41.0)) is None
    assert divergence({0: {30: 4.0}}) is None  # no peers
    found = divergence({0: {30: 4.0, 31: 9.0}, 1: {30: 4.1, 31: 4.0}, 2: {30: 4.0, 31: 4.2}})
    assert found is not None and (found.rank, found.step) == (0, 31) and math.isclose(found.factor, 9.0 / 4.1)
    assert divergence({0: {30: 9.0}, 1: {30: 9.0}, 2: {30: 4.0}}) is None  # two ranks up: not one device
