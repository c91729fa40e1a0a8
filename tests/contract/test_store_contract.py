"""One contract for every EventStore: the in-memory store and the JetStream store must behave alike."""

import asyncio
import contextlib

import pytest

from flightdeck.events import subjects
from flightdeck.events.store import ConcurrencyConflict
from flightdeck.events.subjects import CONTROL, DEAD, TELEMETRY
from tests.contract.store_fixtures import AnyStore, collect, queued, read_all, step, store, tick, within

__all__ = ["store"]  # the parametrised fixture, imported so pytest finds it here

pytestmark = pytest.mark.timeout(60)


async def test_append_assigns_increasing_sequences_per_stream(store: AnyStore) -> None:
    a = await store.append(subjects.job("j1", "JobQueued"), queued("j1", 1, "e1"))
    b = await store.append(subjects.job("j2", "JobQueued"), queued("j2", 2, "e2"))
    t = await store.append(subjects.telemetry("j1", 0, "StepCompleted"), step("j1", 0, 1))
    assert (a.stream, a.seq, a.duplicate) == (CONTROL, 1, False)
    assert (b.seq, t.stream, t.seq) == (2, TELEMETRY, 1)
    assert await store.last_seq(CONTROL) == 2
    assert await store.last_seq(TELEMETRY) == 1
    assert await store.last_seq(DEAD) == 0


async def test_msg_id_dedupes_defaulting_to_the_event_id(store: AnyStore) -> None:
    subject = subjects.job("j", "JobQueued")
    first = await store.append(subject, queued("j", 1, "same"))
    again = await store.append(subject, queued("j", 2, "same"))
    explicit = await store.append(subject, queued("j", 3, "other"), msg_id="m1")
    explicit_again = await store.append(subject, queued("j", 4, "other2"), msg_id="m1")
    assert (again.seq, again.duplicate) == (first.seq, True)
    assert (explicit_again.seq, explicit_again.duplicate) == (explicit.seq, True)
    no_id = [await store.append(subject, queued("j", 5)) for _ in range(2)]  # no id: nothing to dedupe on
    assert [r.duplicate for r in no_id] == [False, False]
    stored = await read_all(store, CONTROL)
    assert [s.msg_id for s in stored] == ["same", "m1", "", ""]
    assert [s.event.priority for s in stored if s.event is not None] == [1, 3, 5, 5]  # type: ignore[attr-defined]


async def test_fenced_append_and_conflict(store: AnyStore) -> None:
    subject = subjects.job("j", "JobQueued")
    r1 = await store.append(subject, queued("j", 1, "a"), expected_last_seq=0)
    await store.append(subjects.job("k", "JobQueued"), queued("k", 1, "other-subject"))
    r2 = await store.append(subject, queued("j", 2, "b"), expected_last_seq=r1.seq)
    with pytest.raises(ConcurrencyConflict) as info:
        await store.append(subject, queued("j", 3, "c"), expected_last_seq=r1.seq)
    assert (info.value.fence, info.value.expected, info.value.actual) == (subject, r1.seq, r2.seq)
    with pytest.raises(ConcurrencyConflict):
        await store.append(subjects.job("new", "JobQueued"), queued("new", 1, "d"), expected_last_seq=5)
    assert await store.last_seq(CONTROL) == 3


async def test_retried_fenced_append_that_landed_is_a_duplicate(store: AnyStore) -> None:
    subject = subjects.job("j", "JobQueued")
    first = await store.append(subject, queued("j", 1, "x"), expected_last_seq=0)
    retry = await store.append(subject, queued("j", 1, "x"), expected_last_seq=0)  # the ack was lost, say
    assert (retry.seq, retry.duplicate) == (first.seq, True)
    assert await store.last_seq(CONTROL) == 1


async def test_fence_is_checked_before_the_msg_id(store: AnyStore) -> None:
    subject = subjects.job("j", "JobQueued")
    first = await store.append(subject, queued("j", 1, "x"), expected_last_seq=0)
    await store.append(subject, queued("j", 2, "y"), expected_last_seq=first.seq)
    with pytest.raises(ConcurrencyConflict):  # others appended since: the stale fence loses...
        await store.append(subject, queued("j", 1, "x"), expected_last_seq=0)
    retry = await store.append(subject, queued("j", 1, "x"), expected_last_seq=2)  # ...a fresh one dedupes
    assert (retry.seq, retry.duplicate) == (first.seq, True)
    assert await store.last_seq(CONTROL) == 2


async def test_wildcard_fence_covers_every_subject_of_a_job(store: AnyStore) -> None:
    fence = subjects.job_all("j")
    a = await store.append(subjects.job("j", "JobQueued"), queued("j", 1, "a"), expected_last_seq=0, fence=fence)
    await store.append(subjects.job("other", "JobQueued"), queued("other", 1, "o"))  # another job: no effect
    b = await store.append(subjects.job("j", "JobCompleted"), queued("j", 2, "b"), expected_last_seq=a.seq,
                           fence=fence)
    with pytest.raises(ConcurrencyConflict) as info:
        await store.append(subjects.job("j", "JobFailed"), queued("j", 3, "c"), expected_last_seq=a.seq, fence=fence)
    assert (info.value.fence, info.value.actual) == (fence, b.seq)
    c = await store.append(subjects.job("j", "JobFailed"), queued("j", 3, "c"), expected_last_seq=b.seq, fence=fence)
    assert c.seq == 4


async def test_read_in_order_with_filters_and_bounds(store: AnyStore) -> None:
    items = []
    for n in range(1, 301):
        job = "a" if n % 3 else "b"
        items.append((subjects.job(job, "JobQueued"), queued(job, n, f"q{n}")))
        if n % 50 == 0:
            items.append(tick("sched", n))
    results = await store.append_batch(items)
    assert [r.seq for r in results] == list(range(1, len(items) + 1))
    everything = await read_all(store, CONTROL)
    assert [s.seq for s in everything] == list(range(1, len(items) + 1))
    assert [s.subject for s in everything] == [subject for subject, _ in items]
    assert all(s.stream == CONTROL and s.error == "" and s.msg_id == s.event.event_id  # type: ignore[union-attr]
               for s in everything)

    only_b = await read_all(store, CONTROL, (subjects.job_all("b"),))
    assert [s.event.priority for s in only_b] == [n for n in range(1, 301) if n % 3 == 0]  # type: ignore[union-attr]
    b_and_clock = await read_all(store, CONTROL, (subjects.job_all("b"), subjects.clock("sched")))
    assert [s.seq for s in b_and_clock] == [s.seq for s in everything if not s.subject.startswith("fd.ctl.job.a.")]

    window = await read_all(store, CONTROL, from_seq=100, until_seq=120)
    assert [s.seq for s in window] == list(range(100, 121))
    filtered_window = await read_all(store, CONTROL, (subjects.job_all("b"),), from_seq=100, until_seq=120)
    assert [s.seq for s in filtered_window] == [s.seq for s in only_b if 100 <= s.seq <= 120]
    assert await read_all(store, CONTROL, from_seq=len(items) + 1) == []
    assert await read_all(store, CONTROL, (subjects.job_all("nobody"),)) == []
    assert await read_all(store, DEAD) == []
    tail = await read_all(store, CONTROL, from_seq=len(items) - 2, until_seq=len(items) + 50)
    assert [s.seq for s in tail] == [len(items) - 2, len(items) - 1, len(items)]


async def test_read_ends_at_the_end_as_of_the_call(store: AnyStore) -> None:
    await store.append_batch([(subjects.job("j", "JobQueued"), queued("j", n, f"e{n}")) for n in range(1, 251)])
    seen = []
    reader = store.read(CONTROL)
    async with contextlib.aclosing(reader):
        async for batch in reader:
            if not seen:
                await store.append(subjects.job("j", "JobQueued"), queued("j", 999, "late"))
            seen.extend(batch)
    assert [s.seq for s in seen] == list(range(1, 251))


async def test_follow_yields_history_then_new_events(store: AnyStore) -> None:
    for n in range(1, 4):
        await store.append(subjects.job("j", "JobQueued"), queued("j", n, f"old{n}"))
    await store.append(subjects.job("x", "JobQueued"), queued("x", 0, "not-followed"))
    follower = store.follow(CONTROL, [subjects.job_all("j")], from_seq=2)
    async with contextlib.aclosing(follower):
        task = asyncio.ensure_future(collect(follower, 5))
        await asyncio.sleep(0.05)
        for n in range(4, 7):
            await store.append(subjects.job("j", "JobQueued"), queued("j", n, f"new{n}"))
        got = await within(10, task)
    assert [s.event.priority for s in got] == [2, 3, 4, 5, 6]  # type: ignore[union-attr]
    assert [s.seq for s in got] == [2, 3, 5, 6, 7]


async def test_last_and_last_seq(store: AnyStore) -> None:
    assert await store.last(CONTROL, subjects.job_all("j")) is None
    await store.append(subjects.job("j", "JobQueued"), queued("j", 1, "a"))
    await store.append(subjects.job("j", "JobCompleted"), queued("j", 2, "b"))
    await store.append(subjects.job("k", "JobQueued"), queued("k", 3, "c"))
    last_j = await store.last(CONTROL, subjects.job_all("j"))
    assert last_j is not None
    assert (last_j.seq, last_j.msg_id, last_j.subject) == (2, "b", subjects.job("j", "JobCompleted"))
    assert last_j.event == queued("j", 2, "b")
    exact = await store.last(CONTROL, subjects.job("j", "JobQueued"))
    assert exact is not None and exact.seq == 1
    assert await store.last_seq(CONTROL) == 3
    assert await store.last(TELEMETRY, "fd.tel.>") is None


async def test_undecodable_bytes_come_back_with_the_reason(store: AnyStore) -> None:
    subject = subjects.job("j", "JobQueued")
    await store.append(subject, queued("j", 1, "good"))
    await store.append_bytes(subject, b"\xc1 not msgpack", msg_id="bad")
    await store.append(subject, queued("j", 2, "good2"))
    stored = await read_all(store, CONTROL)
    assert [s.event is None for s in stored] == [False, True, False]
    bad = stored[1]
    assert bad.error and bad.data == b"\xc1 not msgpack" and bad.msg_id == "bad"
    await store.append_bytes(subject, b"\x81\xa4type\xa7Unknown")  # a tag no code knows
    last = await store.last(CONTROL, subject)
    assert last is not None and last.event is None and last.error


async def test_append_batch_keeps_order_and_dedupes(store: AnyStore) -> None:
    before = await store.append(subjects.job("j", "JobQueued"), queued("j", 0, "early"))
    items = [(subjects.telemetry("j", n % 2, "StepCompleted"), step("j", n % 2, n)) for n in range(1, 401)]
    items.append((subjects.job("j", "JobQueued"), queued("j", 1, "early")))  # already stored
    items.append((subjects.telemetry("j", 1, "StepCompleted"), step("j", 1, 399)))  # twice in this batch
    results = await store.append_batch(items)
    assert [(r.stream, r.seq) for r in results[:400]] == [(TELEMETRY, n) for n in range(1, 401)]
    assert (results[400].seq, results[400].duplicate) == (before.seq, True)
    assert (results[401].seq, results[401].duplicate) == (399, True)
    assert await store.append_batch([]) == []
    stored = await read_all(store, TELEMETRY)
    assert [s.event for s in stored] == [event for _, event in items[:400]]
