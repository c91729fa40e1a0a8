"""The node agent's core, input by input: what it starts, stops, restores, prefetches and forgets."""

from collections.abc import Iterable
from pathlib import Path

import pytest
from msgspec.structs import replace

from flightdeck.events import codec, subjects
from flightdeck.events import nodelocal as nl
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.commands import CheckpointRequested, PauseRequested, RollbackRequested, StopRequested
from flightdeck.events.fleet import NodeLost, NodeRegistered
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobSubmitted,
    RestorePoint,
    SlotRef,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.services.agent import core as agentcore
from flightdeck.services.agent.core import (
    EVICT,
    PREFETCH,
    SPAWN,
    STOP,
    TELL,
    EvictArgs,
    PrefetchArgs,
    Restore,
    SpawnArgs,
    State,
    StopArgs,
    TellArgs,
)
from flightdeck.services.agent.launch import Launch, Paths, rank_env_of
from flightdeck.services.agent.spawner import Spawner
from flightdeck.services.core import Effect
from flightdeck.services.shell.fold import Folder
from flightdeck.services.shell.objects.local import LocalStore
from tests.unit.helpers import numbered

SPEC = JobSpec(name="j", slots=3, train=TrainSpec(steps=20, data="synthetic"))


def run(events: Iterable[Event], state: State | None = None) -> tuple[State, list[Effect]]:
    current = state or State(node="a")
    effects: list[Effect] = []
    for ev in events:
        current, outs = agentcore.transition(current, ev)
        assert all(isinstance(o, Effect) for o in outs), outs  # the agent decides nothing but I/O
        effects.extend(o for o in outs if isinstance(o, Effect))
    return current, effects


def submitted(job: str = "j") -> JobSubmitted:
    return JobSubmitted(job_id=job, spec=SPEC, event_id=f"cli-{job}")


def grant(attempt: int = 0, job: str = "j", *, nodes: tuple[str, ...] = ("a", "b", "a")) -> AllocationGranted:
    refs = [SlotRef(node=n, slot=sum(1 for m in nodes[:i] if m == n), rank=i) for i, n in enumerate(nodes)]
    return AllocationGranted(job_id=job, attempt=attempt, assignments=refs, master_addr="10.0.0.1",
                             master_port=29000 + attempt, event_id=f"grant-{job}-{attempt}")


def committed(cid: str, step: int, job: str = "j") -> CheckpointCommitted:
    return CheckpointCommitted(job_id=job, checkpoint_id=cid, step=step, world_size=3, uri=f"file:///{cid}",
                               bytes=1, data=DataPosition(next_batch=step), manifest_sha256=f"sha-{cid}")


def kinds(effects: list[Effect]) -> list[str]:
    return [e.kind for e in effects]


def test_a_grant_starts_only_this_node_s_ranks_with_the_whole_world_s_rendezvous() -> None:
    _, effects = run([submitted(), grant()])
    (spawn,) = effects
    assert spawn.kind == SPAWN
    args = spawn.args
    assert isinstance(args, SpawnArgs)
    assert [(r.rank, r.slot) for r in args.ranks] == [(0, 0), (2, 1)]
    assert (args.world_size, args.master_addr, args.master_port) == (3, "10.0.0.1", 29000)
    assert (args.spec, args.restore, args.grant_id, args.node) == (SPEC, None, "grant-j-0", "a")


def test_a_grant_with_nothing_on_this_node_starts_nothing() -> None:
    state, effects = run([submitted(), grant(nodes=("b", "c"))])
    assert effects == [] and state.jobs["j"].held is None


def test_the_ranks_restore_what_the_grant_carries_not_the_newest_this_agent_knows() -> None:
    """What a restart restores is the scheduler's choice, recorded in its request and carried by the grant; the agent
    chooses nothing (it once applied the scheduler's rule to its own fold of the same stream)."""
    point = RestorePoint(checkpoint_id="step000000020-a0", step=20, manifest_sha256="sha-step000000020-a0",
                         attempt=0, skips=[(21, 25)])
    state, effects = run([
        submitted(), committed("step000000010-a0", 10), committed("step000000020-a0", 20),
        committed("step000000030-a0", 30), committed("step000000050-a0", 50),
        CheckpointDeleted(job_id="j", checkpoint_id="step000000050-a0"),
        replace(grant(), restore=point, restore_chosen=True), committed("step000000060-a0", 60),
    ])
    assert kinds(effects) == [EVICT, SPAWN, PREFETCH]
    assert effects[0].args == EvictArgs(job_id="j", checkpoint_ids=["step000000050-a0"])
    assert effects[1].args.restore == Restore(checkpoint_id="step000000020-a0", step=20,
                                              manifest_sha256="sha-step000000020-a0")
    assert effects[1].args.skips == [(21, 25)]
    assert effects[2].args == PrefetchArgs(job_id="j", checkpoint=Restore(
        checkpoint_id="step000000060-a0", step=60, manifest_sha256="sha-step000000060-a0"))
    _, again = run([committed("step000000060-a0", 60)], state)
    assert again == []  # the same commit read twice is fetched once
    _, fresh = run([submitted("k"), committed("c30", 30, job="k"), replace(grant(job="k"), restore_chosen=True)])
    (spawn,) = fresh
    assert isinstance(spawn.args, SpawnArgs) and spawn.args.restore is None  # chosen: nothing of its own


def test_a_grant_that_chose_nothing_restores_by_the_scheduler_s_rule_with_the_rollback_s_skip_window() -> None:
    """A grant from a scheduler or resource manager older than the recorded choice (a service-by-service upgrade)
    carries none: the agent applies the scheduler's rule to its own catalog. Trial 7 (86ea31b): a spike's
    RollbackRequested (checkpoint 40, skip batches 40-45) was recorded, rank 1 crashed before the ranks obeyed it,
    and the restart restored the step-40 checkpoint and trained batch 40 again. The window belongs to the timeline:
    a restore of that checkpoint skips it, obeyed or not."""
    rollback = RollbackRequested(job_id="j", checkpoint_id="c40", to_step=40, skip_from=40, skip_to=45,
                                 reason="spike", attempt=0)
    _, effects = run([submitted(), grant(0), committed("c30", 30), committed("c40", 40), rollback,
                      AllocationReleased(job_id="j", attempt=0, reason="rank 1 crashed"), grant(1)])
    spawn = [e.args for e in effects if e.kind == SPAWN][-1]
    assert isinstance(spawn, SpawnArgs) and spawn.attempt == 1
    assert spawn.restore is not None and spawn.restore.checkpoint_id == "c40" and spawn.skips == [(40, 45)]
    # a checkpoint staged after the rollback holds the window itself: nothing more to skip on its restore
    after = replace(committed("c50", 50), timeline=1)
    _, effects = run([submitted(), grant(0), committed("c40", 40), rollback, after,
                      AllocationReleased(job_id="j", attempt=0, reason="rank 1 crashed"), grant(1)])
    spawn = [e.args for e in effects if e.kind == SPAWN][-1]
    assert isinstance(spawn, SpawnArgs) and spawn.restore is not None
    assert spawn.restore.checkpoint_id == "c50" and spawn.skips == []


def test_checkpoints_of_a_job_not_running_here_are_not_prefetched() -> None:
    _, effects = run([submitted(), committed("c1", 10), grant(nodes=("b",)), committed("c2", 20)])
    assert effects == []


def test_a_rollback_fetches_its_checkpoint_again_for_the_ranks_here_only() -> None:
    """A rollback's ranks read its checkpoint from the cache: a copy gone since its prefetch is downloaded again."""
    rollback = RollbackRequested(job_id="j", checkpoint_id="c1", to_step=10, skip_from=15, skip_to=20, reason="spike")
    _, effects = run([submitted(), committed("c1", 10), grant(), committed("c2", 20), rollback])
    assert kinds(effects) == [SPAWN, PREFETCH, TELL, PREFETCH]
    assert effects[-1].args == PrefetchArgs(job_id="j", checkpoint=Restore(checkpoint_id="c1", step=10,
                                                                           manifest_sha256="sha-c1"), rollback=True)
    assert effects[-2].args == TellArgs(job_id="j", attempt=0, command=codec.encode(rollback))
    _, effects = run([submitted(), committed("c1", 10), grant(nodes=("b",)), rollback])
    assert effects == []  # no rank of the job here
    _, effects = run([submitted(), committed("c1", 10), grant(), replace(rollback, checkpoint_id="c9")])
    assert kinds(effects) == [SPAWN, TELL]  # a checkpoint this node does not know of: the ranks say so
    _, effects = run([submitted(), committed("c1", 10), grant(), replace(rollback, attempt=3)])
    assert kinds(effects) == [SPAWN]  # another attempt's rollback: not for the ranks running here


def test_commands_go_down_to_the_attempt_running_here_and_plans_to_the_job() -> None:
    """The agent is its ranks' only link: each command of the job reaches the attempt it runs, in history order,
    and the resharder's plan is passed on when recorded and given at the next start."""
    stop, pause = StopRequested(job_id="j", event_id="s"), PauseRequested(job_id="j", event_id="p")
    plan = ParallelPlan(world_size=3, dp=3)
    state, effects = run([submitted(), pause, grant(2), stop])
    assert [e.args for e in effects if e.kind == TELL] == [TellArgs(job_id="j", attempt=2, command=codec.encode(stop))]
    state, effects = run([ReshardPlanned(job_id="j", old=None, new=plan, reason="r"), CheckpointRequested(job_id="j")],
                         state)
    assert kinds(effects) == [TELL, TELL] and effects[0].args == TellArgs(job_id="j", plan=plan)
    _, effects = run([grant(3)], state)
    spawn = [e.args for e in effects if e.kind == SPAWN][-1]
    assert isinstance(spawn, SpawnArgs) and spawn.plan == plan  # known at the start: the rank need not wait
    _, effects = run([submitted("k"), grant(0, "k", nodes=("b",)), StopRequested(job_id="k")])
    assert effects == []  # no rank of that job here


def test_a_release_stops_the_attempt_held_here_and_a_late_grant_for_it_starts_nothing() -> None:
    state, effects = run([submitted(), grant(0), AllocationReleased(job_id="j", attempt=1, reason="stale")])
    assert kinds(effects) == [SPAWN]  # another attempt's release leaves these ranks alone
    state, effects = run([AllocationReleased(job_id="j", attempt=0, reason="failed: rank 1 exited")], state)
    assert [e.args for e in effects] == [StopArgs(job_id="j", attempt=0, reason="released: failed: rank 1 exited")]
    _, effects = run([grant(0)], state)
    assert effects == []


def test_a_new_attempt_kills_the_old_one_before_starting() -> None:
    _, effects = run([submitted(), grant(0), grant(1, nodes=("a",))])
    assert kinds(effects) == [SPAWN, STOP, SPAWN]
    assert effects[1].args == StopArgs(job_id="j", attempt=0, reason="attempt 1 replaces it", immediate=True)
    assert effects[2].args.attempt == 1 and effects[2].args.world_size == 1


def test_a_new_attempt_placed_elsewhere_still_stops_the_old_one_here() -> None:
    state, effects = run([submitted(), grant(0), grant(1, nodes=("b",))])
    assert kinds(effects) == [SPAWN, STOP] and state.jobs["j"].held is None


def test_a_grant_read_twice_starts_the_ranks_once() -> None:
    _, effects = run([submitted(), grant(0), grant(0)])
    assert kinds(effects) == [SPAWN]


@pytest.mark.parametrize("end", [JobCancelled(job_id="j", reason="operator"), JobCompleted(job_id="j", steps=20)])
def test_a_job_that_ends_is_stopped_evicted_and_forgotten(end: Event) -> None:
    state, effects = run([submitted(), committed("c1", 10), grant(0), end])
    assert kinds(effects) == [SPAWN, STOP, EVICT]
    assert effects[2].args == EvictArgs(job_id="j", checkpoint_ids=[])
    assert "j" not in state.jobs and "j" in state.ended
    _, later = run([submitted(), grant(1)], state)
    assert later == []


@pytest.mark.parametrize("end", [JobFailed(job_id="j", reason="rank 0 crashed"), JobCompleted(job_id="j", steps=20)])
def test_a_job_that_ran_here_frees_its_snapshots_however_it_ends_with_or_without_a_checkpoint(end: Event) -> None:
    """Issue 51: a job that failed in 1 s, nothing committed, kept its ranks' snapshot slots in shared memory."""
    _, effects = run([submitted(), grant(0), end])
    assert kinds(effects) == [SPAWN, STOP, EVICT]
    assert effects[2].args == EvictArgs(job_id="j", checkpoint_ids=[])
    _, elsewhere = run([submitted(), grant(0, nodes=("b", "b", "b")), end])  # none of its ranks ran here
    assert elsewhere == []


def test_live_ranks_follow_this_node_s_starts_and_exits() -> None:
    state, _ = run([
        WorkersStarted(job_id="j", node="a", attempt=0, ranks=[0, 2], pids=[100, 102]),
        WorkersStarted(job_id="j", node="b", attempt=0, ranks=[1], pids=[200]),
        WorkersExited(job_id="j", node="a", attempt=0, rank=0, exit_code=0),
        WorkersExited(job_id="j", node="b", attempt=0, rank=1, exit_code=0),
    ])
    assert list(state.live) == ["j/0/2"] and state.live["j/0/2"].pid == 102


def test_the_service_reads_its_inputs_and_asks_only_for_effects_it_can_run(tmp_path: Path) -> None:
    spawner = Spawner(node="a", producer="agent-a", store=MemoryStore(), objects=LocalStore(tmp_path / "objects"),
                      paths=Paths(tmp_path), launch=Launch(device="cpu", grace_s=1.0))
    service = agentcore.core_service("a", spawner.handlers())
    assert service.name == "agent-a" and not service.wants_tick(service.initial, 0.0)
    assert "fd.ctl.job.*.AllocationGranted" in service.control_subjects
    assert {"fd.ctl.node.a.NodeLost", "fd.ctl.node.a.NodeRegistered"} <= set(service.control_subjects)  # its own
    assert not any(s.startswith("fd.ctl.node.b.") or s.startswith("fd.ctl.node.*.") for s in service.control_subjects)
    folder = Folder(service)
    steps = []
    for seq, ev in enumerate(numbered([submitted(), grant()]), start=1):
        subject = subjects.job(ev.job_id, type(ev).__name__)
        steps.extend(folder.apply(Stored(subjects.CONTROL, seq, subject, b"", "", ev)))
    assert [s.error for s in steps] == ["", ""]
    assert [e.kind for e in steps[-1].effects] == [SPAWN]
    with pytest.raises(ValueError, match="stop"):
        agentcore.core_service("a", {k: v for k, v in spawner.handlers().items() if k != STOP})


def test_a_grant_older_than_one_already_seen_starts_nothing() -> None:
    """Found by the property test: attempt 1 went elsewhere, then attempt 0's grant was read again."""
    _, effects = run([submitted(), grant(0), grant(1, nodes=("b",)), grant(0)])
    assert kinds(effects) == [SPAWN, STOP]
    # A release that overtakes its own grant (the scheduler moved on while asking) makes that grant stale too.
    _, effects = run([submitted(), AllocationReleased(job_id="j", attempt=0, reason="restart"), grant(0)])
    assert effects == []


def test_a_grant_without_snapshot_room_here_starts_these_ranks_without_snapshots_and_says_why(tmp_path: Path) -> None:
    why = "a's snapshot memory (1.00 GiB, 0.90 GiB of it held for other ranks) cannot hold 2 more rank(s)"
    no_room = replace(grant(), snapshots_off={"a": why, "c": "not ours"})
    (spawn,) = run([submitted(), no_room])[1]
    assert isinstance(spawn.args, SpawnArgs) and spawn.args.snapshots_off == why
    (elsewhere,) = run([submitted(), replace(grant(), snapshots_off={"b": why})])[1]
    assert isinstance(elsewhere.args, SpawnArgs) and elsewhere.args.snapshots_off == ""
    paths = Paths(tmp_path, snapshots=tmp_path / "shm")
    launch = Launch(device="cpu", grace_s=1.0)
    env = rank_env_of(spawn.args, spawn.args.ranks[0], tmp_path / "spec.toml", None, frozenset(), node="a",
                      paths=paths, launch=launch, link="")
    assert env[nl.SNAPSHOTS_OFF_ENV] == why and nl.SNAPSHOTS_ENV not in env
    env = rank_env_of(elsewhere.args, elsewhere.args.ranks[0], tmp_path / "spec.toml", None, frozenset(), node="a",
                      paths=paths, launch=launch, link="")
    assert env[nl.SNAPSHOTS_ENV] == str(tmp_path / "shm") and nl.SNAPSHOTS_OFF_ENV not in env


def test_a_node_declared_lost_while_its_agent_runs_fences_and_joins_again() -> None:
    """Issue 51: an agent frozen past the lost deadline (SIGSTOP, a stall) resumed and stayed lost for ever. Its own
    NodeLost after its registration asks for the rejoin effect (fence every rank here, self-check, register); one
    before it (an earlier agent's), another node's, or a second one before it registered again asks for nothing."""
    lost = NodeLost(node="a", reason="its agent, which ran ranks of j-1, has sent no heartbeat batch for 2s")
    state, effects = run([lost, NodeLost(node="b", reason="x")])
    assert effects == [] and not state.registered
    state, effects = run([NodeRegistered(node="a", kind="cpu", slots=2), lost], state)
    assert [(e.kind, e.args) for e in effects] == [(agentcore.REJOIN, agentcore.RejoinArgs(reason=lost.reason))]
    state, effects = run([lost], state)
    assert effects == [] and not state.registered
    state, effects = run([NodeRegistered(node="a", kind="cpu", slots=2), NodeLost(node="b", reason="x")], state)
    assert effects == [] and state.registered
