"""Following stops on its condition, and a reader's failure is told as itself: follow_all once asked a still-running
reader for its result when another failed, which hid the failure behind an InvalidStateError."""

import asyncio

import pytest

from flightdeck.events.store import MemoryStore
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
