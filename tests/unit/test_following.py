"""Following stops on its condition, and a reader's failure is told as itself: follow_all once asked a still-running
reader for its result when another failed, which hid the failure behind an InvalidStateError."""

import asyncio

import pytest

from flightdeck.events import subjects
from flightdeck.events.job import WorkersExited
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.events.training import FaultInjected, Heartbeat
from flightdeck.services.tools.console import following
from flightdeck.services.tools.console.following import follow_all


class Broken(Exception):
    pass


class OneStreamFails(MemoryStore):
    def follow(self, stream, subjects=(), *, from_seq=1):  # type: ignore[no-untyped-def]
        if stream == "FD_TELEMETRY":
            return self._broken()
        return super().follow(stream, subjects, from_seq=from_seq)

    async def _broken(self):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        raise Broken("the telemetry reader failed")
        yield


async def test_a_failed_reader_is_told_as_itself_and_the_condition_is_stopped() -> None:
    store = OneStreamFails()
    stopped = asyncio.Event()

    async def never() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    chosen = [("FD_CONTROL", ["fd.ctl.>"]), ("FD_TELEMETRY", ["fd.tel.>"])]
    with pytest.raises(Broken, match="the telemetry reader failed"):
        await follow_all(store, chosen, {"FD_CONTROL": 0, "FD_TELEMETRY": 0}, lambda s: None, never())
    assert stopped.is_set()


def fault(at: float) -> FaultInjected:
    return FaultInjected(job_id="j", rank=1, node="n", kind="crash", step=25, event_id="f", occurred_at=at)


def beat(at: float) -> Heartbeat:
    return Heartbeat(job_id="j", rank=0, node="n", step=30, interval_s=1.0, event_id="h", occurred_at=at)


def exited(at: float) -> WorkersExited:
    return WorkersExited(job_id="j", node="n", attempt=0, rank=1, exit_code=3, event_id="x", occurred_at=at)


async def test_a_live_control_event_waits_for_telemetry_that_happened_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Stored in causal order, yet the telemetry reader delivers its fault after the control reader's exit.
    monkeypatch.setattr(following, "HOLD_S", 3600.0)
    store = MemoryStore()
    told: list[str] = []
    done = asyncio.Event()

    def show(stored: Stored) -> None:
        told.append(type(stored.event).__name__)
        if len(told) == 3:
            done.set()

    chosen = [("FD_CONTROL", ["fd.ctl.>"]), ("FD_TELEMETRY", ["fd.tel.>"])]
    following_ = asyncio.create_task(
        follow_all(store, chosen, {"FD_CONTROL": 0, "FD_TELEMETRY": 0}, show, done.wait()))
    await store.append(subjects.job("j", "WorkersExited"), exited(20.0))
    for _ in range(20):
        await asyncio.sleep(0)  # the control reader has it, and waits
    assert told == []
    await store.append(subjects.telemetry("j", 1, "FaultInjected"), fault(10.0))
    for _ in range(20):
        await asyncio.sleep(0)
    assert told == ["FaultInjected"]  # telemetry has not reached the exit's time yet: it may hold more before it
    await store.append(subjects.telemetry("j", 0, "Heartbeat"), beat(30.0))
    await asyncio.wait_for(following_, 60.0)
    assert told[0] == "FaultInjected" and sorted(told[1:]) == ["Heartbeat", "WorkersExited"]


async def test_a_control_event_is_not_held_for_ever_by_a_quiet_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(following, "HOLD_S", 0.01)
    store = MemoryStore()
    told: list[Stored] = []
    done = asyncio.Event()

    def show(stored: Stored) -> None:
        told.append(stored)
        done.set()

    chosen = [("FD_CONTROL", ["fd.ctl.>"]), ("FD_TELEMETRY", ["fd.tel.>"])]
    await store.append(subjects.job("j", "WorkersExited"), exited(20.0))
    await asyncio.wait_for(follow_all(store, chosen, {"FD_CONTROL": 0, "FD_TELEMETRY": 0}, show, done.wait()), 60.0)
    assert [type(s.event) for s in told] == [WorkersExited]
