"""One WorkersExited per node (issue 17, item 4): the cores read every rank a node's record holds, as they read
one record per rank, and the agent's recorder writes ranks it stopped as one record."""

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.commands import StopRequested
from flightdeck.events.findings import RankLost
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    JobCompleted,
    JobFailed,
    RankExit,
    SlotRef,
    WorkersExited,
    WorkersStarted,
    exits_record,
)
from flightdeck.events.store import MemoryStore
from flightdeck.services.agent import exits as exits_mod
from flightdeck.services.agent.exits import ExitRecorder
from flightdeck.services.agent.spawner import retrying
from flightdeck.services.health.core import core_service as health_service
from flightdeck.services.scheduler.core import core_service as scheduler_service
from tests.unit.helpers import events_of, fold, register, submit
from tests.unit.test_scheduler_lifecycle import grant, started

SCHEDULER = scheduler_service(stop_timeout_s=30.0)


def node_record(job: str, exits: list[RankExit], attempt: int = 0, node: str = "a") -> WorkersExited:
    return exits_record(exits, job_id=job, node=node, attempt=attempt, event_id=f"x-{node}-{exits[0].rank}",
                        occurred_at=1.0)


def test_the_first_failed_rank_heads_a_record_and_the_rest_follow_by_rank() -> None:
    ev = node_record("j", [RankExit(rank=5, exit_code=0), RankExit(rank=3, exit_code=3, cause="Traceback ..."),
                           RankExit(rank=2, exit_code=-15)])
    assert (ev.rank, ev.exit_code, ev.cause) == (3, 3, "Traceback ...")
    assert [x.rank for x in ev.others] == [2, 5]
    assert [x.rank for x in ev.exits()] == [3, 2, 5]
    assert ev.schema_version == 2 and codec.decode(codec.encode(ev)) == ev
    alone = node_record("j", [RankExit(rank=1, exit_code=0)])
    assert alone.schema_version == 1 and alone.exits() == [RankExit(rank=1, exit_code=0)]


def test_a_record_of_every_rank_finishing_completes_the_job() -> None:
    state, _ = fold(SCHEDULER, [register("a", 4), submit("j", slots=4), grant("j", "a", 4),
                                started("j", "a", [0, 1, 2, 3])])
    state, outs = fold(SCHEDULER, [node_record("j", [RankExit(rank=r, exit_code=0) for r in range(4)])], state)
    assert [type(e).__name__ for e in events_of(outs)] == ["JobCompleted", "AllocationReleased", "JobPhaseChanged"]
    assert state.jobs.get("j") is None or state.jobs["j"].phase != "running"


def test_a_failed_rank_in_a_node_record_restarts_the_job_once_and_counts_the_others_gone() -> None:
    state, _ = fold(SCHEDULER, [register("a", 2), register("b", 2), submit("j", slots=4),
                                grant_two_nodes("j"), started("j", "a", [0, 1]), started("j", "b", [2, 3])])
    record = node_record("j", [RankExit(rank=1, exit_code=7, cause="boom"), RankExit(rank=0, exit_code=-9)])
    state, outs = fold(SCHEDULER, [record], state)
    decided = events_of(outs)
    assert [type(e).__name__ for e in decided][:2] == ["StopRequested", "AllocationReleased"]
    stop = decided[0]
    assert isinstance(stop, StopRequested) and "rank 1 exited with code 7 (with rank 0 on a): boom" in stop.reason
    job = state.jobs["j"]
    assert job.attempt == 1 and job.restarts == 1
    # the other node's record of the ranks the restart stopped changes nothing more
    state, outs = fold(SCHEDULER, [node_record("j", [RankExit(rank=2, exit_code=-15), RankExit(rank=3, exit_code=-15)],
                                               node="b")], state)
    assert events_of(outs) == [] and state.jobs["j"].restarts == 1


def test_an_unrunnable_node_record_fails_the_job_without_a_restart() -> None:
    state, _ = fold(SCHEDULER, [register("a", 2), submit("j", slots=2), grant("j", "a", 2)])
    record = node_record("j", [RankExit(rank=r, exit_code=125, cause="no such program", unrunnable=True)
                               for r in (0, 1)])
    state, outs = fold(SCHEDULER, [record], state)
    (failed,) = events_of(outs, JobFailed)
    assert "not restarted: the job's command cannot run" in failed.reason
    assert events_of(outs, AllocationReleased) and not events_of(outs, JobCompleted)


def test_a_stop_ends_once_every_node_record_is_in() -> None:
    state, _ = fold(SCHEDULER, [register("a", 2), register("b", 2), submit("j", slots=4, priority=10),
                                grant_two_nodes("j"), started("j", "a", [0, 1]), started("j", "b", [2, 3])])
    # a higher-priority job preempts it: the stop finishes when all four ranks are gone
    state, outs = fold(SCHEDULER, [submit("k", slots=4, priority=90)], state)
    assert events_of(outs, StopRequested)
    stopped = [RankExit(rank=0, exit_code=-15), RankExit(rank=1, exit_code=-15)]
    state, outs = fold(SCHEDULER, [node_record("j", stopped)], state)
    assert not events_of(outs, AllocationReleased)
    state, outs = fold(SCHEDULER, [node_record("j", [RankExit(rank=2, exit_code=-15), RankExit(rank=3, exit_code=-15)],
                                               node="b")], state)
    assert [e.reason for e in events_of(outs, AllocationReleased)] != []


def grant_two_nodes(job: str) -> AllocationGranted:
    return AllocationGranted(job_id=job, attempt=0, master_port=29501,
                             assignments=[SlotRef(node="a" if r < 2 else "b", slot=r % 2, rank=r) for r in range(4)])


def test_the_health_monitor_finds_each_failed_rank_of_a_record_lost() -> None:
    service = health_service()
    state, _ = fold(service, [submit("j", slots=4), grant_two_nodes("j"),
                              WorkersStarted(job_id="j", node="a", attempt=0, ranks=[0, 1], pids=[1, 2]),
                              WorkersStarted(job_id="j", node="b", attempt=0, ranks=[2, 3], pids=[3, 4])])
    record = node_record("j", [RankExit(rank=0, exit_code=0), RankExit(rank=1, exit_code=-11)])
    state, outs = fold(service, [record], state)
    assert [(e.rank, e.reason) for e in events_of(outs, RankLost)] == [(1, "exited with code -11")]


# -- the agent's recorder, on an in-memory store ---------------------------------------------------------------

async def recorded(store: MemoryStore) -> list[WorkersExited]:
    out: list[WorkersExited] = []
    async for batch in store.read(subjects.CONTROL, [subjects.job_node("j", "a", "WorkersExited")]):
        out += [s.event for s in batch if isinstance(s.event, WorkersExited)]
    return out


async def test_ranks_the_agent_stopped_are_recorded_together_once_the_last_has_exited() -> None:
    store = MemoryStore()
    watched = {0, 1, 2}
    recorder = ExitRecorder(store, "a", "agent-a", lambda job, attempt: set(watched), retrying)
    recorder.stopping("j", 0)
    first = asyncio.create_task(recorder.record("j", 0, [RankExit(rank=1, exit_code=-15)], "g0"))
    second = asyncio.create_task(recorder.record("j", 0, [RankExit(rank=0, exit_code=-15)], "g0"))
    await asyncio.sleep(0.05)
    assert await recorded(store) == [] and not first.done()  # rank 2 has not exited yet
    await recorder.record("j", 0, [RankExit(rank=2, exit_code=-9)], "g0")
    await asyncio.gather(first, second)
    (ev,) = await recorded(store)
    assert (ev.rank, ev.exit_code, [x.rank for x in ev.others]) == (1, -15, [0, 2])  # the first to exit heads it
    assert ev.event_id == "agent-a:exit:j:0:0" and ev.causation_id == "g0"
    assert ev.job_version == 0  # a node record: outside the history's numbering


async def test_a_rank_that_ends_by_itself_is_recorded_at_once() -> None:
    store = MemoryStore()
    watched = {0, 1}
    recorder = ExitRecorder(store, "a", "agent-a", lambda job, attempt: set(watched), retrying)
    await recorder.record("j", 0, [RankExit(rank=1, exit_code=3, cause="boom")], "g0")
    (ev,) = await recorded(store)
    assert (ev.rank, ev.exit_code, ev.others) == (1, 3, [])
    watched.discard(1)
    recorder.stopping("j", 0)  # then the scheduler's restart stops rank 0
    await recorder.record("j", 0, [RankExit(rank=0, exit_code=-15)], "g0")
    assert [(e.rank, e.exit_code) for e in await recorded(store)] == [(1, 3), (0, -15)]


async def test_a_stopped_rank_that_never_exits_does_not_hold_the_others_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exits_mod, "STOPPED_WAIT_S", 0.05)
    store = MemoryStore()
    recorder = ExitRecorder(store, "a", "agent-a", lambda job, attempt: {0, 1}, retrying)
    recorder.stopping("j", 0)
    await asyncio.wait_for(recorder.record("j", 0, [RankExit(rank=0, exit_code=-15)], "g0"), 30)
    assert [(e.rank, e.others) for e in await recorded(store)] == [(0, [])]
    await recorder.close()


async def test_a_wait_that_runs_out_while_a_record_is_in_flight_is_recorded_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exits_mod, "STOPPED_WAIT_S", 0.05)
    store, gate = MemoryStore(), asyncio.Event()

    async def held(what: str, fn: Callable[[], Awaitable[object]]) -> object:
        await gate.wait()  # the broker is slow: the first record stays in flight
        return await retrying(what, fn)

    recorder = ExitRecorder(store, "a", "agent-a", lambda job, attempt: {0, 1, 2}, held)
    first = asyncio.create_task(recorder.record("j", 0, [RankExit(rank=1, exit_code=3)], "g0"))  # by itself
    await asyncio.sleep(0.01)
    recorder.stopping("j", 0)  # the restart stops the others; rank 2 will not die
    second = asyncio.create_task(recorder.record("j", 0, [RankExit(rank=0, exit_code=-15)], "g0"))
    await asyncio.sleep(0.2)  # rank 0's wait for rank 2 runs out while rank 1's record is still in flight
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert [(e.rank, e.others) for e in await recorded(store)] == [(1, []), (0, [])]
