"""The checkpoint core: the all-ranks rule (every rank staged, and its agent reported its shards stored), stale and
duplicate stagings, retention and rollback holds. `run` folds an agent's report after each staging, as a node with
one rank sends it, so each test reads its outputs at the staging's index; the tests of the reports fold their own."""

from collections.abc import Iterable, Sequence

import msgspec
import pytest
from msgspec.structs import replace

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointFailed,
    CheckpointRejected,
    CheckpointScrubbed,
    CheckpointsFailing,
    CheckpointsRecovered,
    CheckpointStaged,
    DataPosition,
    FinalStateSaved,
    FinalStateUnsaved,
    ShardInfo,
    ShardsUploaded,
)
from flightdeck.events.clock import ClockTick
from flightdeck.events.codec import encode
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import JobCancelled, JobCompleted, JobFailed, JobResumed, JobSubmitted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import RankStarted, RolledBack
from flightdeck.services.checkpoints import core
from flightdeck.services.checkpoints.core import checkpoint_id
from flightdeck.services.checkpoints.scrubs import SCRUB
from flightdeck.services.checkpoints.state import CommitArgs, DeleteArgs, Settings, State
from flightdeck.services.core import Effect, Emit, Output
from flightdeck.services.shell.fold import Folder
from tests.unit.helpers import numbered

JOB = "llm-abc123"


def staged(rank: int, step: int, world: int, *, attempt: int = 0, at: float = 0.0, job: str = JOB,
           timeline: int = 0) -> CheckpointStaged:
    return CheckpointStaged(
        job_id=job, rank=rank, attempt=attempt, node=f"n{rank}", step=step, world_size=world,
        staging_dir=f"/stage/{job}/step-{step}", data=DataPosition(next_batch=step * 10),
        shards=[ShardInfo(path=f"__{rank}_0.distcp", size=10 + rank, sha256=f"{rank:x}" * 64)],
        stall_s=0.01, write_s=0.1, occurred_at=at, timeline=timeline,
    )


def committed(step: int, *, attempt: int = 0, world: int = 2, job: str = JOB, timeline: int = 0) -> CheckpointCommitted:
    return CheckpointCommitted(job_id=job, checkpoint_id=checkpoint_id(attempt, step, timeline), step=step,
                               world_size=world, uri="file:///x", bytes=1, data=DataPosition(next_batch=0),
                               attempt=attempt, timeline=timeline)


def tick(now: float) -> ClockTick:
    return ClockTick(service=core.SERVICE, now=now, positions={}, occurred_at=now)


def submitted(keep: int, job: str = JOB) -> JobSubmitted:
    return JobSubmitted(job_id=job, spec=JobSpec(name="llm", policy=PolicySpec(keep_checkpoints=keep)))


LIVE = State(settings=Settings(shards_from="agents", settle_on_exits="yes", supersede="parked",  # as the service runs
                               retention="steps", claims="verify", failing_after=core.FAILING_AFTER,
                               fence="lost", final_late="amended"))


def stored(ev: CheckpointStaged, *, ranks: list[int] | None = None, failed: str = "") -> ShardsUploaded:
    """What the node agent of `ev`'s rank reports once it put the rank's shards into the store."""
    return ShardsUploaded(job_id=ev.job_id, rank=ev.rank, attempt=ev.attempt, node=ev.node, step=ev.step,
                          timeline=ev.timeline, world_size=ev.world_size, ranks=ranks or [ev.rank], bytes=10,
                          seconds=0.1, failed=failed, occurred_at=ev.occurred_at)


def run(events: Iterable[Event], state: State | None = None, *,
        reports: bool = True) -> tuple[State, list[list[Output]]]:
    state = state if state is not None else LIVE
    outs = []
    for ev in events:
        state, decided = core.transition(state, ev)
        decided = list(decided)
        if reports and isinstance(ev, CheckpointStaged):
            state, more = core.transition(state, stored(ev))
            decided += more
        outs.append(decided)
    return state, outs


def commits(outs: Sequence[Sequence[Output]]) -> list[CommitArgs]:
    return [o.args for step in outs for o in step if isinstance(o, Effect) and o.kind == core.COMMIT]


def deleted(outs: Sequence[Sequence[Output]]) -> list[str]:
    return [o.event.checkpoint_id for step in outs for o in step
            if isinstance(o, Emit) and isinstance(o.event, CheckpointDeleted)]


def test_commit_is_asked_once_when_the_last_rank_stages() -> None:
    _, outs = run([staged(2, 50, 3, at=1.0), staged(0, 50, 3, at=2.0), staged(1, 50, 3, at=3.0)])
    assert outs[0] == [] and outs[1] == []
    [effect] = outs[2]
    assert isinstance(effect, Effect) and effect.kind == core.COMMIT
    args = effect.args
    assert args.checkpoint_id == checkpoint_id(0, 50) and args.step == 50 and args.world_size == 3
    assert [r.rank for r in args.ranks] == [0, 1, 2]
    assert args.created_at == 3.0 and args.data == DataPosition(next_batch=500)
    assert args.ranks[2].shards == staged(2, 50, 3).shards and args.ranks[2].node == "n2"


def test_duplicates_and_late_copies_are_ignored() -> None:
    _, outs = run([staged(0, 50, 2), staged(0, 50, 2), staged(1, 50, 2), staged(1, 50, 2), staged(0, 50, 2)])
    assert [len(o) for o in outs] == [0, 0, 1, 0, 0]


def test_a_rank_staging_the_same_set_again_replaces_its_announcement() -> None:
    again = msgspec.structs.replace(staged(0, 50, 2), shards=[ShardInfo(path="__0_0.distcp", size=99, sha256="f" * 64)])
    _, outs = run([staged(0, 50, 2), again, staged(1, 50, 2)])
    [args] = commits(outs)
    assert args.ranks[0].shards == again.shards


def test_steps_and_jobs_are_counted_apart() -> None:
    _, outs = run([staged(0, 50, 2), staged(1, 75, 2), staged(0, 50, 2, job="other-000001"),
                   staged(1, 50, 2), staged(0, 75, 2)])
    assert [(a.job_id, a.step) for a in commits(outs)] == [(JOB, 50), (JOB, 75)]


def test_stagings_of_an_older_attempt_are_ignored_once_a_newer_one_runs() -> None:
    _, outs = run([
        staged(0, 50, 2, attempt=0),  # half a set from attempt 0...
        RankStarted(job_id=JOB, rank=0, attempt=1, world_size=2, from_step=25, device="cpu"),
        staged(1, 50, 2, attempt=0),  # ...its other half arrives after attempt 1 started: stale
        staged(0, 50, 2, attempt=1), staged(1, 50, 2, attempt=1),
        staged(0, 75, 2, attempt=0), staged(1, 75, 2, attempt=0),  # a zombie rank of attempt 0
    ])
    assert [(a.attempt, a.step) for a in commits(outs)] == [(1, 50)]


def test_a_newer_attempt_staging_drops_the_older_partial_set() -> None:
    state, outs = run([staged(0, 50, 2, attempt=0), staged(0, 60, 2, attempt=1), staged(1, 50, 2, attempt=0)])
    assert commits(outs) == []
    assert list(state.jobs[JOB].staging) == [(1, 0, 60)]  # (attempt, timeline, step)


def test_final_checkpoint_of_a_preempted_attempt_still_commits() -> None:
    # the next attempt is only allocated (not running) when the final staging is folded
    _, outs = run([staged(0, 90, 2, attempt=0), staged(1, 90, 2, attempt=0)])
    assert [(a.attempt, a.step) for a in commits(outs)] == [(0, 90)]


@pytest.mark.parametrize("bad", [
    staged(2, 50, 2),  # rank outside the world
    staged(1, 50, 3),  # disagrees with the set's world size
])
def test_inconsistent_stagings_are_ignored(bad: CheckpointStaged) -> None:
    state, outs = run([staged(0, 50, 2), bad])
    assert commits(outs) == [] and set(state.jobs[JOB].staging[(0, 0, 50)].ranks) == {0}


@pytest.mark.parametrize("end", [JobCancelled(job_id=JOB), JobFailed(job_id=JOB, reason="x")])
def test_a_failed_or_cancelled_job_commits_nothing(end: Event) -> None:
    _, outs = run([staged(0, 50, 2), end, staged(1, 50, 2)])
    assert commits(outs) == []


def test_a_completed_job_still_commits_what_its_ranks_staged_before_exiting() -> None:
    """The service folds telemetry only at its ticks, so the last stagings (written before the ranks
    exited 0) can be read after JobCompleted: they are the job's final state and are committed."""
    spec = JobSpec(name="llm", train=TrainSpec(steps=60, checkpoint_every=10))
    svc = core.core_service({"commit": _nothing, "delete": _nothing, "scrub": _nothing})
    state, outs = run([JobSubmitted(job_id=JOB, spec=spec), staged(0, 50, 2), staged(0, 60, 2),
                       JobCompleted(job_id=JOB, steps=60, occurred_at=100.0)])
    assert commits(outs) == []
    assert svc.wants_tick(state, 101.0), "the final step's set is due: keep folding telemetry"
    assert svc.wants_tick(state, 100.0 + core.LINGER_S)  # one tick more, which says the final state is unsaved
    lingered, _ = run([tick(100.0 + core.LINGER_S)], state)
    assert not svc.wants_tick(lingered, 101.0 + core.LINGER_S), "but not forever (a later report prompts its own)"
    state, outs = run([staged(1, 50, 2), staged(1, 60, 2), staged(0, 70, 2, attempt=1)], state)
    assert [(a.step, a.attempt) for a in commits(outs)] == [(50, 0), (60, 0)]  # nothing from another attempt
    assert not svc.wants_tick(state, 101.0)


def test_a_completed_job_whose_last_step_is_no_checkpoint_stops_ticking() -> None:
    spec = JobSpec(name="llm", train=TrainSpec(steps=65, checkpoint_every=10))
    svc = core.core_service({"commit": _nothing, "delete": _nothing, "scrub": _nothing})
    state, _ = run([JobSubmitted(job_id=JOB, spec=spec), JobCompleted(job_id=JOB, steps=65, occurred_at=100.0)])
    assert not svc.wants_tick(state, 101.0)


async def _nothing(args: object) -> list[Emit]:
    return []


def test_retention_ranks_by_step_as_a_restart_does_whatever_order_the_commits_came_in() -> None:
    """Uploads that finish out of order commit out of order (a loaded CI run: 5, 15, 10, 25, 20, 30). In commit
    order retention kept step 20 over 25; with keep 1 and a late commit of an older step it would delete the
    highest step, the one a restart restores (lineage.newest). Histories recorded before replay commit order."""
    order = [5, 15, 10, 25, 20, 30]
    _, outs = run([submitted(keep=2)] + [committed(s) for s in order])
    assert deleted(outs) == [checkpoint_id(0, s) for s in (5, 10, 15, 20)]
    _, outs = run([submitted(keep=1), committed(30), committed(25)])
    assert deleted(outs) == [checkpoint_id(0, 25)]  # never the restart's target
    recorded = State(settings=msgspec.structs.replace(LIVE.settings, retention="commits"))
    _, outs = run([submitted(keep=2)] + [committed(s) for s in order], recorded)
    assert deleted(outs) == [checkpoint_id(0, s) for s in (5, 15, 10, 25)]


def test_retention_keeps_the_newest_k_and_deletes_each_once() -> None:
    events: list[Event] = [submitted(keep=2)] + [committed(s) for s in (10, 20, 30, 40)]
    state, outs = run(events)
    assert deleted(outs) == [checkpoint_id(0, 10), checkpoint_id(0, 20)]
    effects = [o for step in outs for o in step if isinstance(o, Effect)]
    assert [e.args for e in effects] == [DeleteArgs(job_id=JOB, checkpoint_ids=[checkpoint_id(0, s)]) for s in (10, 20)]
    emits = [o for step in outs for o in step if isinstance(o, Emit)]
    assert all(e.subject == subjects.job(JOB, "CheckpointDeleted") for e in emits)
    # the deletions come back as inputs: nothing more is decided, and the state forgets them
    state, outs = run([CheckpointDeleted(job_id=JOB, checkpoint_id=checkpoint_id(0, s)) for s in (10, 20)], state)
    assert outs == [[], []]
    assert [c.step for c in state.jobs[JOB].committed] == [30, 40] and not state.jobs[JOB].doomed


def test_a_repeated_commit_event_is_counted_once() -> None:
    _, outs = run([submitted(keep=1), committed(10), committed(10), committed(20)])
    assert deleted(outs) == [checkpoint_id(0, 10)]


def test_rollback_target_is_kept_until_every_rank_rolled_back() -> None:
    target = checkpoint_id(0, 10)
    state, outs = run([
        submitted(keep=1), committed(10, world=2),
        RollbackRequested(job_id=JOB, checkpoint_id=target, to_step=10, skip_from=100, skip_to=120, reason="spike"),
        committed(20, timeline=1), committed(30, timeline=1),
    ])
    assert deleted(outs) == [checkpoint_id(0, 20, 1)]  # 10 is held, 30 is the newest
    roll = [RolledBack(job_id=JOB, rank=r, checkpoint_id=target, to_step=10, skip_from=100, skip_to=120)
            for r in (0, 0, 1)]
    _, outs = run(roll, state)
    assert [deleted([o]) for o in outs] == [[], [], [target]]


def test_a_rollback_throws_away_the_older_timeline_above_its_step_and_commits_the_redone_steps() -> None:
    """Checkpoints of the steps a rollback throws away are deleted (even one committed after it), never committed
    from a staging read after it, and the same steps redone on the new timeline are checkpoints of their own."""
    rollback = RollbackRequested(job_id=JOB, checkpoint_id=checkpoint_id(0, 10), to_step=10, skip_from=30,
                                 skip_to=35, reason="spike", attempt=0)
    state, outs = run([submitted(keep=5), committed(10), committed(20), committed(30), staged(0, 40, 2), rollback])
    assert deleted(outs) == [checkpoint_id(0, 20), checkpoint_id(0, 30)]
    assert {o.event.reason for step in outs for o in step if isinstance(o, Emit)} == {core.THROWN_AWAY}
    assert state.jobs[JOB].staging == {}  # the half-staged step 40 of the old timeline is dropped
    state, outs = run([staged(1, 40, 2), committed(40), staged(0, 20, 2, timeline=1), staged(1, 20, 2, timeline=1)],
                      state)
    assert deleted(outs) == [checkpoint_id(0, 40)]  # committed late, thrown away at once
    assert [(a.checkpoint_id, a.step, a.timeline) for a in commits(outs)] == [(checkpoint_id(0, 20, 1), 20, 1)]
    _, outs = run([committed(20, timeline=1), RollbackRequested(job_id=JOB, checkpoint_id=checkpoint_id(0, 20, 1),
                                                                to_step=20, skip_from=30, skip_to=40, reason="again")],
                  state)
    assert deleted(outs) == []  # timeline 2 starts at 20: nothing above it yet
    assert checkpoint_id(0, 20, 1) == "step000000020-a0-t1" and checkpoint_id(1, 20) == "step000000020-a1"


def test_restart_target_is_kept_until_its_attempt_started() -> None:
    target = checkpoint_id(0, 10)
    state, outs = run([
        submitted(keep=1), committed(10),
        JobResumed(job_id=JOB, attempt=1, from_step=10, checkpoint_id=target, world_size=2),
        committed(20, attempt=1),
        RankStarted(job_id=JOB, rank=0, attempt=1, world_size=2, from_step=10, device="cpu"),
    ])
    assert deleted(outs) == []
    _, outs = run([RankStarted(job_id=JOB, rank=1, attempt=1, world_size=2, from_step=10, device="cpu")], state)
    assert deleted(outs) == [target]


def test_job_end_releases_holds() -> None:
    target = checkpoint_id(0, 10)
    _, outs = run([
        submitted(keep=1), committed(10),
        RollbackRequested(job_id=JOB, checkpoint_id=target, to_step=10, skip_from=0, skip_to=1, reason="x"),
        committed(20, timeline=1), JobCompleted(job_id=JOB, steps=30),
    ])
    assert deleted(outs) == [target]
    assert deleted(outs[-1:]) == [target]


def test_state_survives_a_msgpack_snapshot() -> None:
    state, _ = run([submitted(keep=2), staged(0, 5, 2), committed(1), committed(2), committed(3),
                    RollbackRequested(job_id=JOB, checkpoint_id=checkpoint_id(0, 2), to_step=2, skip_from=0, skip_to=1,
                                      reason="x")])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=State) == state


def test_service_wiring() -> None:
    async def nothing(args: object) -> list[Emit]:
        return []

    with pytest.raises(ValueError, match="delete"):
        core.core_service({"commit": nothing, "scrub": nothing})
    with pytest.raises(ValueError, match="scrub"):  # a claim's read needs it, with scheduled scrubs off too
        core.core_service({"commit": nothing, "delete": nothing})
    svc = core.core_service({"commit": nothing, "delete": nothing, "scrub": nothing})
    assert "fd.tel.*.*.CheckpointStaged" in svc.telemetry_subjects
    assert "fd.ctl.job.*.CheckpointCommitted" in svc.control_subjects
    assert not svc.wants_tick(svc.initial, 0.0)
    state, _ = run([staged(0, 5, 2)])
    assert svc.wants_tick(state, 0.0)
    state, _ = run([JobCompleted(job_id=JOB, steps=6)], state)
    assert not svc.wants_tick(state, 0.0)


def test_outputs_pass_the_shared_fold() -> None:
    """Through services/shell/fold.py: telemetry folded at a tick, outputs stamped and checked against the grammar."""

    async def nothing(args: object) -> list[Emit]:
        return []

    folder = Folder(core.core_service({"commit": nothing, "delete": nothing, "scrub": nothing}))

    def as_stored(stream: str, seq: int, subject: str, ev: Event) -> Stored:
        return Stored(stream=stream, seq=seq, subject=subject, data=encode(ev), msg_id="", event=ev)

    sets = [staged(r, 50, 2) for r in (0, 1)]
    tel = [as_stored(subjects.TELEMETRY, i + 1, subjects.telemetry(JOB, ev.rank, type(ev).__name__), ev)
           for i, ev in enumerate([*sets, stored(sets[0], ranks=[0, 1])])]
    tick = ClockTick(service=core.SERVICE, now=1.0, positions={subjects.TELEMETRY: 3})
    steps = folder.apply(as_stored(subjects.CONTROL, 1, subjects.clock(core.SERVICE), tick), tel)
    assert [s.error for s in steps] == ["", "", "", ""]
    assert [len(s.effects) for s in steps] == [0, 0, 1, 0]
    seq = 1
    for ev in numbered([submitted(keep=1), committed(10), committed(20)]):
        seq += 1
        [step] = folder.apply(as_stored(subjects.CONTROL, seq, subjects.job(JOB, type(ev).__name__), ev))
        assert step.error == ""
    assert [o.event.checkpoint_id for o in step.outputs] == [checkpoint_id(0, 10)]
    assert step.outputs[0].msg_id == f"{core.SERVICE}:{subjects.CONTROL}:{seq}:0"


def rejected_by(node: str, step: int, attempt: int = 1) -> CheckpointRejected:
    return CheckpointRejected(job_id=JOB, checkpoint_id=checkpoint_id(0, step), step=step, attempt=attempt, node=node,
                              cause=f"checkpoint {JOB}/{checkpoint_id(0, step)} has no manifest")


def claim_reads(outs: Sequence[Sequence[Output]]) -> list[tuple[str, str]]:
    return [(o.args.checkpoint_id, o.args.claim_node) for step in outs for o in step
            if isinstance(o, Effect) and o.kind == SCRUB]


def read_back(step: int, node: str, cause: str = "") -> CheckpointScrubbed:
    return CheckpointScrubbed(job_id=JOB, checkpoint_id=checkpoint_id(0, step), step=step, bytes=1, seconds=0.1,
                              cause=cause, claim_node=node, claim_cause="no manifest", schema_version=2)


def test_a_nodes_claim_deletes_nothing_until_the_services_own_read_confirms_it() -> None:
    """Issue 51: one node blind to the store (a missing mount, wrong credentials) rejected 175, 150 and 125 in turn,
    and each was deleted from the real store on its word. A claim is one witness: the service reads the checkpoint
    back itself (claimed ones first, with scheduled scrubs off), and only a finding of that read makes it bad."""
    state, outs = run([submitted(keep=3), committed(125), committed(150), committed(175),
                       rejected_by("n2", 175), rejected_by("n2", 150, attempt=2), rejected_by("n2", 125, attempt=3),
                       rejected_by("n3", 175, attempt=4)])
    assert deleted(outs) == [] and state.jobs[JOB].bad == {}
    assert [(c.checkpoint_id, c.node) for c in state.claims] == \
        [(checkpoint_id(0, 175), "n2"), (checkpoint_id(0, 150), "n2"), (checkpoint_id(0, 125), "n2")]  # one a set
    state, outs = run([tick(1.0)], state)
    assert claim_reads(outs) == [(checkpoint_id(0, 175), "n2")]  # one read at a time, the oldest claim first
    state, outs = run([tick(2.0)], state)
    assert claim_reads(outs) == []
    state, outs = run([read_back(175, "n2"), tick(3.0)], state)  # intact: the node is the suspect, not the set
    assert deleted(outs) == [] and claim_reads(outs) == [(checkpoint_id(0, 150), "n2")]
    state, outs = run([read_back(150, "n2", cause="shard '__0_0.distcp' is missing from the store"), tick(4.0)],
                      state)
    assert deleted(outs) == [checkpoint_id(0, 150)]  # confirmed by a second witness: bad, and deleted as such
    (emit,) = [o for o in outs[0] if isinstance(o, Emit)]
    assert emit.event.reason == core.CONFIRMED
    assert claim_reads(outs) == [(checkpoint_id(0, 125), "n2")]
    state, outs = run([read_back(125, "n2"), tick(5.0)], state)
    assert deleted(outs) == [] and state.claims == () and claim_reads(outs) == []
    assert {c.checkpoint_id for c in state.jobs[JOB].committed} >= {checkpoint_id(0, 125), checkpoint_id(0, 175)}


def test_a_claim_on_a_checkpoint_deleted_meanwhile_is_dropped_unread() -> None:
    state, _ = run([submitted(keep=1), committed(10), committed(20), rejected_by("n2", 10)])
    state, _ = run([CheckpointDeleted(job_id=JOB, checkpoint_id=checkpoint_id(0, 10))], state)
    state, outs = run([tick(1.0)], state)
    assert claim_reads(outs) == [] and state.claims == ()


def test_a_rejected_checkpoint_was_deleted_on_the_claim_alone_in_histories_recorded_before() -> None:
    """Settings.claims "trust": as such histories ran, so that they still verify."""
    trusting = replace(LIVE, settings=replace(LIVE.settings, claims="trust"))
    rejected = CheckpointRejected(job_id=JOB, checkpoint_id=checkpoint_id(0, 20), step=20, attempt=1, node="n1",
                                  cause="shard '__0_0.distcp' ... sha256 ...")
    state, outs = run([submitted(keep=2), committed(10), committed(20), rejected], trusting)
    assert deleted(outs) == [checkpoint_id(0, 20)]  # the last good one, step 10, stays
    (emit,) = [o for o in outs[-1] if isinstance(o, Emit)]
    assert emit.event.reason == core.REJECTED and state.claims == ()
    state, outs = run([CheckpointDeleted(job_id=JOB, checkpoint_id=checkpoint_id(0, 20), reason=core.REJECTED),
                       committed(30)], state)
    assert deleted(outs) == []  # 10 and 30 are the two good ones kept
    state, outs = run([committed(40)], state)
    assert deleted(outs) == [checkpoint_id(0, 10)]


def test_nothing_commits_until_every_ranks_agent_reports_its_shards_stored() -> None:
    a, b = staged(0, 50, 2, at=1.0), staged(1, 50, 2, at=2.0)
    _, outs = run([a, b, stored(a), stored(b, ranks=[1])], reports=False)
    assert outs[:3] == [[], [], []]
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 50)] and commits(outs[3:])


def test_one_report_covers_a_nodes_ranks_and_counts_only_ranks_that_staged() -> None:
    a, b, c = staged(0, 50, 3), staged(1, 50, 3), staged(2, 50, 3)
    _, outs = run([a, b, stored(a, ranks=[0, 1, 2]), c], reports=False)  # rank 2's report came before it staged
    assert commits(outs) == []
    _, outs = run([a, b, stored(a, ranks=[0, 1]), c, stored(c)], reports=False)
    assert [len(o) for o in outs] == [0, 0, 0, 0, 1] and commits(outs)[0].world_size == 3


def test_a_rank_staging_again_waits_for_its_agent_to_store_the_new_files() -> None:
    a, b = staged(0, 50, 2), staged(1, 50, 2)
    again = msgspec.structs.replace(b, shards=[ShardInfo(path="__1_0.distcp", size=99, sha256="9" * 64)])
    _, outs = run([a, stored(a), b, stored(b)], reports=False)
    assert len(commits(outs)) == 1
    _, outs = run([a, stored(a), b, again, stored(b)], reports=False)
    [args] = commits(outs)
    assert args.ranks[1].shards == again.shards  # the store must hold what the newest announcement says


def test_a_node_that_could_not_store_its_shards_fails_the_checkpoint_and_removes_what_was_stored() -> None:
    a, b = staged(0, 50, 2), staged(1, 50, 2)
    state, outs = run([a, stored(a), b, stored(b, failed="shard '__1_0.distcp' of rank 1 is corrupt")],
                      reports=False)
    failed = [o.event for o in outs[3] if isinstance(o, Emit)]
    assert len(failed) == 1 and isinstance(failed[0], CheckpointFailed) and failed[0].step == 50
    assert failed[0].reason == (f"{checkpoint_id(0, 50)}: node n1 could not store its ranks' shards: "
                                "shard '__1_0.distcp' of rank 1 is corrupt")
    assert [o.args for o in outs[3] if isinstance(o, Effect)] == [DeleteArgs(job_id=JOB,
                                                                            checkpoint_ids=[checkpoint_id(0, 50)])]
    _, later = run([stored(b)], state)  # a late report of the set changes nothing: it is never committed
    assert later == [[]] and commits(outs) == []


def test_a_history_from_before_agents_stored_shards_commits_on_the_stagings_alone() -> None:
    _, outs = run([staged(0, 50, 2), staged(1, 50, 2)], core.State(), reports=False)
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 50)] and outs[0] == []


def test_a_set_persisted_from_memory_commits_as_such_and_never_mixes_with_a_ranks_own() -> None:
    def memory(rank: int, step: int) -> CheckpointStaged:
        return msgspec.structs.replace(staged(rank, step, 2), from_memory=True)

    _, outs = run([memory(0, 27), memory(1, 27)])
    (args,) = commits(outs)
    assert args.from_memory and args.checkpoint_id == checkpoint_id(0, 27)
    # one rank's own set and another's snapshot of the same step are two formats: never one checkpoint
    _, outs = run([staged(0, 30, 2), memory(1, 30)])
    assert commits(outs) == []


def _granted(attempt: int, nodes: dict[int, str]) -> Event:
    from flightdeck.events.job import AllocationGranted, SlotRef
    return AllocationGranted(job_id=JOB, attempt=attempt,
                             assignments=[SlotRef(node=n, slot=0, rank=r) for r, n in sorted(nodes.items())])


def test_a_lost_nodes_ranks_leave_a_replicated_set_to_the_survivors_and_a_sharded_one_failed() -> None:
    """After a node is lost its ranks' memory is gone: the survivors' snapshots commit alone when each is a full
    replica (plain data parallel), whichever comes first, the loss or their stagings; a sharded set fails at once,
    so that no restart waits for it."""
    from flightdeck.events.fleet import NodeLost

    def memory(rank: int, replicated: bool) -> CheckpointStaged:
        return msgspec.structs.replace(staged(rank, 27, 4), from_memory=True, replicated=replicated,
                                       node="a" if rank < 2 else "b")

    placed = _granted(0, {0: "a", 1: "a", 2: "b", 3: "b"})
    lost = NodeLost(node="b", reason="its agent went silent")
    # the survivors stage first, then the loss is known
    state, outs = run([placed, memory(0, True), memory(1, True)])
    assert commits(outs) == []
    state, decided = core.transition(state, lost)
    (commit,) = [o.args for o in decided if isinstance(o, Effect) and o.kind == core.COMMIT]
    assert [r.rank for r in commit.ranks] == [0, 1] and commit.world_size == 4 and commit.from_memory
    # the loss first: the last survivor's report settles it
    _, outs = run([placed, lost, memory(0, True), memory(1, True)])
    assert [[r.rank for r in c.ranks] for c in commits(outs)] == [[0, 1]]
    # without a loss nothing commits short of every rank
    _, outs = run([placed, memory(0, True), memory(1, True), memory(2, True)])
    assert commits(outs) == []
    # sharded state: the set can never be whole
    state, outs = run([placed, lost, memory(0, False), memory(1, False)])
    assert commits(outs) == []
    (failed,) = [o.event for step in outs for o in step
                 if isinstance(o, Emit) and isinstance(o.event, CheckpointFailed)]
    assert "ranks [2, 3] were on lost node(s) b" in failed.reason


def test_ranks_whose_exits_say_none_was_staged_leave_the_set_to_the_others_as_a_lost_node_does() -> None:
    """A rank whose agent had no snapshot newer than its checkpoints stages none, and its exit record says so
    (RankExit.persisted): the others' set commits at once when each is a full replica, and fails at once when
    sharded, rather than hold a restart up until its wait runs out. Histories recorded before exits said so replay
    without it."""
    from flightdeck.events.job import RankExit, WorkersExited

    def memory(rank: int, replicated: bool) -> CheckpointStaged:
        return msgspec.structs.replace(staged(rank, 27, 2), from_memory=True, replicated=replicated)

    placed = _granted(0, {0: "a", 1: "a"})
    said = WorkersExited(job_id=JOB, node="a", attempt=0, rank=1, exit_code=3, persisted="none",
                         others=[RankExit(rank=0, exit_code=-15, persisted="staged")])
    assert LIVE.settings.settle_on_exits == "yes"
    _, outs = run([placed, memory(0, True), said])
    (commit,) = commits(outs)
    assert [r.rank for r in commit.ranks] == [0] and commit.world_size == 2 and commit.from_memory
    _, outs = run([placed, said, memory(0, True)])  # the exit first: the survivor's report settles it
    assert [[r.rank for r in c.ranks] for c in commits(outs)] == [[0]]
    _, outs = run([placed, memory(0, False), said])
    (failed,) = [o.event for step in outs for o in step
                 if isinstance(o, Emit) and isinstance(o.event, CheckpointFailed)]
    assert "ranks [1] had no snapshot of it to stage" in failed.reason and commits(outs) == []
    staged_said = msgspec.structs.replace(said, persisted="staged")  # rank 1's may still come: wait
    _, outs = run([placed, memory(0, True), staged_said])
    assert commits(outs) == [] and not any(isinstance(o, Emit) for step in outs for o in step)
    before = msgspec.structs.replace(LIVE, settings=msgspec.structs.replace(LIVE.settings, settle_on_exits="no"))
    _, outs = run([placed, memory(0, True), said], before)
    assert commits(outs) == []


def test_what_a_claimed_checkpoint_falls_back_to_is_kept_until_the_read_decides() -> None:
    """A rollback's target refused by a node (claimed bad) must not let retention delete what the rollback falls
    back to if the read confirms it: a loaded CI run committed step 40 meanwhile, retention kept 20, 30 and 40,
    deleted 10, and the confirmed-bad 20 left the rollback nothing to fall back to (the job failed)."""
    state, _ = run([submitted(keep=3), committed(10), committed(20), committed(30), rejected_by("n1", 20)])
    assert state.jobs[JOB].doubted == {checkpoint_id(0, 20)}
    state, outs = run([committed(40)], state)
    assert deleted(outs) == []  # 10, 30 and 40 are the three counted; 20 kept besides, doubted
    state, outs = run([read_back(20, "n1", cause="shard '__0_0.distcp' is missing from the store")], state)
    assert deleted(outs) == [checkpoint_id(0, 20)] and state.jobs[JOB].doubted == frozenset()
    state, _ = run([CheckpointDeleted(job_id=JOB, checkpoint_id=checkpoint_id(0, 20), reason=core.CONFIRMED)], state)
    assert [c.step for c in state.jobs[JOB].committed] == [10, 30, 40]


def test_a_claim_read_back_intact_counts_among_the_kept_again() -> None:
    state, _ = run([submitted(keep=2), committed(10), committed(20), rejected_by("n2", 20), committed(30)])
    assert [c.step for c in state.jobs[JOB].committed] == [10, 20, 30]  # 20 doubted: 10 and 30 are the two counted
    state, outs = run([read_back(20, "n2")], state)
    assert deleted(outs) == [checkpoint_id(0, 10)]  # 20 and 30 now


def refused(step: int, *, store: bool = True) -> CheckpointFailed:
    """The service's own CheckpointFailed, read back: the store refused the set (ENOSPC), or it could never be whole."""
    return CheckpointFailed(job_id=JOB, step=step, checkpoint_id=checkpoint_id(0, step), store=store,
                            reason=f"{checkpoint_id(0, step)}: node n1 could not store its ranks' shards: "
                                   "OSError(28, 'No space left on device')" if store else "ranks were on lost nodes")


def findings(outs: Sequence[Sequence[Output]]) -> list[Event]:
    return [o.event for step in outs for o in step if isinstance(o, Emit)
            and isinstance(o.event, CheckpointsFailing | CheckpointsRecovered | FinalStateUnsaved | FinalStateSaved)]


def test_a_store_that_refuses_a_jobs_checkpoints_is_an_incident_until_one_commits() -> None:
    """Issue 51: 34 uploads failed on a full store, each with a clear log line, and nothing said so."""
    state, outs = run([submitted(keep=3), committed(50), refused(60), refused(65, store=False), refused(70)])
    assert findings(outs) == []  # two of the store's, and one that was never the store's: no incident yet
    state, outs = run([refused(80)], state)
    (failing,) = findings(outs)
    assert isinstance(failing, CheckpointsFailing)
    assert (failing.failures, failing.first_step, failing.step, failing.newest_step) == (3, 60, 80, 50)
    assert "No space left on device" in failing.reason
    state, outs = run([refused(90), refused(100)], state)
    assert findings(outs) == []  # said once a streak
    state, outs = run([committed(110)], state)
    assert findings(outs) == [CheckpointsRecovered(job_id=JOB, step=110, failures=5)]
    state, outs = run([refused(120), refused(130)], state)
    assert findings(outs) == []  # a new streak counts from its start


def test_a_completed_job_whose_final_state_is_not_stored_says_so() -> None:
    every = JobSubmitted(job_id=JOB, spec=JobSpec(name="j", train=TrainSpec(steps=100, checkpoint_every=10)))
    done = JobCompleted(job_id=JOB, steps=100, occurred_at=500.0)
    final = [staged(0, 100, 2), staged(1, 100, 2)]  # every rank staged step 100: handed over for its commit
    # its final set failed after the completion
    state, outs = run([every, committed(90), *final, done, refused(100)])
    (unsaved,) = findings(outs)
    assert isinstance(unsaved, FinalStateUnsaved) and (unsaved.step, unsaved.newest_step) == (100, 90)
    assert "its final checkpoint failed" in unsaved.reason and "the newest saved state is step 90" in unsaved.reason
    # ... before it: said at the completion
    _, outs = run([every, committed(90), *final, refused(100), done])
    assert [type(e).__name__ for e in findings(outs)] == ["FinalStateUnsaved"]
    # saved: nothing said
    _, outs = run([every, committed(90), *final, done, committed(100)])
    assert findings(outs) == []
    # never staged by every rank: said once the linger is over, at a tick
    state, outs = run([every, committed(90), staged(0, 100, 2), done], reports=False)
    state, outs = run([tick(500.0 + core.LINGER_S - 1)], state)
    assert findings(outs) == [] and core.wants_tick(state, 500.0 + core.LINGER_S + 5)
    state, outs = run([tick(500.0 + core.LINGER_S)], state)
    (unsaved,) = findings(outs)
    assert "was not staged by every rank within 30s" in unsaved.reason
    assert not core.wants_tick(state, 500.0 + core.LINGER_S + 5)
    # ... and its last rank's staging comes after all: handed over, and its commit amends what was said
    late, outs = run([stored(staged(0, 100, 2)), staged(1, 100, 2)], state)
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 100)]
    _, outs = run([committed(100)], late)
    assert findings(outs) == [FinalStateSaved(job_id=JOB, step=100, checkpoint_id=checkpoint_id(0, 100))]
    kept = replace(late, settings=replace(late.settings, final_late="kept"))  # histories recorded before: as then
    _, outs = run([committed(100)], kept)
    assert findings(outs) == []
    # no final set due (100 is not a multiple of 30), while the store refused the last three
    thirty = JobSubmitted(job_id=JOB, spec=JobSpec(name="j", train=TrainSpec(steps=100, checkpoint_every=30)))
    _, outs = run([thirty, committed(30), refused(60), refused(90), refused(90, store=True), done])
    assert [type(e).__name__ for e in findings(outs)] == ["CheckpointsFailing", "FinalStateUnsaved"]
    assert "its checkpoints were failing when it completed (3 in a row since step 60)" in findings(outs)[1].reason


def test_histories_recorded_before_say_neither() -> None:
    older = replace(LIVE, settings=replace(LIVE.settings, failing_after=0))
    _, outs = run([submitted(keep=3), committed(50), refused(60), refused(70), refused(80),
                   JobCompleted(job_id=JOB, steps=80)], older)
    assert findings(outs) == []
