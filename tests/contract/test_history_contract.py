"""Job histories on every store: contiguous versions, own retries recognised, gaps refused, racing writers."""

import asyncio

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.admission import admitted_events
from flightdeck.events.history import HistoryGap, append_to_job, junk, node_record, read_job, version_of
from flightdeck.events.job import JobCompleted, JobQueued, WorkersStarted
from tests.contract.store_fixtures import AnyStore, queued, store

__all__ = ["store"]

pytestmark = pytest.mark.timeout(60)


async def test_versions_run_one_two_three_across_types(store: AnyStore) -> None:
    await store.append(subjects.job("other", "JobQueued"), queued("other", 0, "noise"))
    r1 = await append_to_job(store, queued("j", 1, "a"))
    r2 = await append_to_job(store, JobCompleted(job_id="j", steps=10, event_id="b"))
    r3 = await append_to_job(store, queued("j", 3, "c"))
    assert [r.duplicate for r in (r1, r2, r3)] == [False, False, False]
    history = await read_job(store, "j")
    assert [version_of(s) for s in history] == [1, 2, 3]
    assert [s.seq for s in history] == [r1.seq, r2.seq, r3.seq]
    assert history[1].subject == subjects.job("j", "JobCompleted")
    assert history[1].event == JobCompleted(job_id="j", steps=10, event_id="b", job_version=2)
    assert await read_job(store, "nobody") == []


async def test_a_retry_of_a_landed_append_is_recognised(store: AnyStore) -> None:
    first = await append_to_job(store, queued("j", 1, "e1"), msg_id="svc:FD_CONTROL:7:0")
    again = await append_to_job(store, queued("j", 1, "e1"), msg_id="svc:FD_CONTROL:7:0")
    assert (again.seq, again.duplicate) == (first.seq, True)
    await append_to_job(store, queued("j", 2, "e2"))
    late = await append_to_job(store, queued("j", 1, "e1"), msg_id="svc:FD_CONTROL:7:0")  # others appended since
    assert (late.seq, late.duplicate) == (first.seq, True)
    assert [version_of(s) for s in await read_job(store, "j")] == [1, 2]


async def test_a_gap_in_versions_is_refused(store: AnyStore) -> None:
    await append_to_job(store, queued("j", 1, "a"))
    await store.append(subjects.job("j", "JobQueued"), JobQueued(job_id="j", priority=2, job_version=5, event_id="b"))
    with pytest.raises(HistoryGap, match=r"job j: expected job_version 2 at stream sequence 2, found 5"):
        await read_job(store, "j")
    assert len(await read_job(store, "j", check=False)) == 2


async def test_an_unversioned_or_repeated_event_is_passed_over_not_a_stall(store: AnyStore) -> None:
    # One publisher that bypasses the fence (version 0), or replays an old message (version 1 again), must not
    # stop the job's writers nor restart its numbering: the history goes on past them, and every reader skips them.
    await append_to_job(store, queued("j", 1, "a"))
    await store.append(subjects.job("j", "JobQueued"), queued("j", 2, "raw"))  # bypassed the history: version 0
    r = await append_to_job(store, queued("j", 3, "b"))
    await append_to_job(store, queued("j", 4, "c"))
    await store.append(subjects.job("j", "JobQueued"), msgspec.structs.replace(queued("j", 5, "again"), job_version=1))
    history = await read_job(store, "j")  # contiguous over what is admitted: no HistoryGap
    assert [version_of(s) for s in history] == [1, 0, 2, 3, 1] and history[2].seq == r.seq
    assert [junk(s) for s in history] == [False, True, False, False, False]  # a repeat needs its history to tell
    assert [e.event_id for e in admitted_events(history)] == ["a", "b", "c"]


async def test_an_undecodable_event_keeps_its_version(store: AnyStore) -> None:
    await append_to_job(store, queued("j", 1, "a"))
    # a newer writer's event: unknown type to this code, but its job_version is still readable
    newer = msgspec.msgpack.encode({"type": "FromTheFuture", "job_id": "j", "job_version": 2, "novel": [1]})
    await store.append_bytes(subjects.job("j", "FromTheFuture"), newer, msg_id="future")
    r = await append_to_job(store, queued("j", 3, "c"))
    history = await read_job(store, "j")
    assert history[1].event is None and history[1].error
    assert [version_of(s) for s in history] == [1, 2, 3] and history[2].seq == r.seq


async def test_concurrent_writers_never_share_a_version(store: AnyStore) -> None:
    writers, each = 6, 8

    async def writer(w: int) -> None:
        for n in range(each):
            await append_to_job(store, queued("race", w * 100 + n, f"w{w}-{n}"))
            await asyncio.sleep(0)

    await asyncio.gather(*(writer(w) for w in range(writers)))
    history = await read_job(store, "race")
    assert [version_of(s) for s in history] == list(range(1, writers * each + 1))
    assert len({s.msg_id for s in history}) == writers * each


def started(node: str, attempt: int = 0) -> WorkersStarted:
    return WorkersStarted(job_id="j", node=node, attempt=attempt, ranks=[0], pids=[1],
                          event_id=f"agent-{node}:start:j:{attempt}")


async def test_node_records_stand_outside_the_numbering_under_their_node(store: AnyStore) -> None:
    await append_to_job(store, queued("j", 1, "a"))
    # A restart's node records, all at once: no fence to race, so none is retried or refused.
    landed = await asyncio.gather(*(append_to_job(store, started(f"n{i}")) for i in range(16)))
    again = await append_to_job(store, started("n3"))  # an agent's retry of a record that landed
    await append_to_job(store, JobCompleted(job_id="j", steps=10, event_id="b"))
    history = await read_job(store, "j")  # checks versions 1, 2 over the versioned events
    assert [type(s.event).__name__ for s in history] == ["JobQueued", *["WorkersStarted"] * 16, "JobCompleted"]
    assert [version_of(s) for s in history] == [1, *[0] * 16, 2]
    assert {s.subject for s in history[1:17]} == {subjects.job_node("j", f"n{i}", "WorkersStarted") for i in range(16)}
    assert again.duplicate and again.seq == landed[3].seq
    assert not any(junk(s) for s in history) and [node_record(s) for s in history] == [False, *[True] * 16, False]


async def test_a_numbered_node_record_of_an_older_history_still_counts(store: AnyStore) -> None:
    await append_to_job(store, queued("j", 1, "a"))
    await store.append(subjects.job("j", "WorkersStarted"), msgspec.structs.replace(started("n1"), job_version=2),
                       msg_id="old")  # as histories recorded before node subjects hold it
    await append_to_job(store, queued("j", 3, "c"))
    assert [version_of(s) for s in await read_job(store, "j")] == [1, 2, 3]
    # ... and a node record under another node's subject is junk: it does not stand where its event says
    await store.append(subjects.job_node("j", "n2", "WorkersStarted"), started("n1", 1), msg_id="forged")
    history = await read_job(store, "j")
    assert junk(history[-1]) and not node_record(history[-1])
