"""Job histories on every store: contiguous versions, own retries recognised, gaps refused, racing writers."""

import asyncio

import msgspec
import pytest

from events import subjects
from events.history import HistoryGap, append_to_job, read_job, version_of
from events.job import JobCompleted, JobQueued
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


async def test_an_unversioned_last_message_stops_appends(store: AnyStore) -> None:
    await store.append(subjects.job("j", "JobQueued"), queued("j", 1, "raw"))  # bypassed the history: version 0
    with pytest.raises(HistoryGap):
        await append_to_job(store, queued("j", 2, "next"))


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
