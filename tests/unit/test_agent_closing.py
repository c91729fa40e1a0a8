"""A stopping agent closes each part within a bound (services/agent/closing.py): one that never finishes is
cancelled and named in the log, and the agent goes on stopping; one that fails still fails; one that closes is
awaited to its end."""

import asyncio

import pytest
from structlog.testing import capture_logs

from flightdeck.services.agent.closing import close_within


async def test_a_part_that_never_closes_is_cancelled_named_and_left_behind() -> None:
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    with capture_logs() as logs:
        await close_within("standby pool", hangs(), within_s=0.05)
    await asyncio.wait_for(cancelled.wait(), 10)  # a hang guard: the cancel reaches the part
    assert [(e["event"], e["part"]) for e in logs] == [
        ("a part did not close in time; the agent stops without it", "standby pool")]


async def test_a_part_that_closes_is_awaited_and_one_that_fails_raises() -> None:
    done: list[str] = []

    async def closes() -> None:
        await asyncio.sleep(0)
        done.append("closed")

    async def fails() -> None:
        raise RuntimeError("broken socket")

    with capture_logs() as logs:
        await close_within("node view", closes())
        with pytest.raises(RuntimeError, match="broken socket"):
            await close_within("heartbeat relay", fails())
    assert done == ["closed"] and logs == []


async def test_a_part_left_behind_is_logged_with_where_it_waits() -> None:
    parked = asyncio.Event()

    async def inner_wait() -> None:
        await parked.wait()

    async def outer_close() -> None:
        await inner_wait()

    with capture_logs() as logs:
        await close_within("fork server", outer_close(), within_s=0.05)
    [entry] = logs
    names = [where.rsplit(" ", 1)[-1] for where in entry["awaiting"][:-1]]
    # Every coroutine down the chain, outermost first, then what the innermost one waits on: a future.
    assert names == ["outer_close", "inner_wait", "wait"]
    assert entry["awaiting"][-1] == "FutureIter"
