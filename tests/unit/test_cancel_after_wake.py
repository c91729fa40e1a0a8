"""A loop that waits for an event with a timeout still stops when it is cancelled just after the event was set.
On Python 3.11 `asyncio.wait_for` swallows such a cancel (cpython gh-86296, fixed in 3.12): the loop goes round
again and whoever awaits its end on close hangs. The waits in long-lived loops use `asyncio.timeout` instead."""

import ast
import asyncio
from pathlib import Path

from flightdeck.events.heartbeats import RankHeartbeats
from flightdeck.services.agent.beats import BeatRelay

ROOT = Path(__file__).resolve().parents[2]
JOB = "wake-000001"
HANG_GUARD_S = 30.0  # a hang guard, not a speed bound: a close that works takes milliseconds


async def test_the_heartbeat_relay_closes_when_a_wake_came_just_before_the_close() -> None:
    published: list[RankHeartbeats] = []
    first = asyncio.Event()

    async def publish(batch: RankHeartbeats) -> None:
        published.append(batch)
        first.set()

    relay = BeatRelay(node="n1", producer="agent-n1", publish=publish)
    relay.start()
    relay.hold(JOB, 0, 5.0, 0)  # a held attempt: a batch now, the next in 5 s, so the flusher waits with a timeout
    await asyncio.wait_for(first.wait(), HANG_GUARD_S)
    await asyncio.sleep(0.05)  # the flusher is in its timed wait
    relay.hold(JOB, 1, 5.0, 0)  # a new attempt's ranks start: that wakes the flusher ...
    closing = asyncio.create_task(relay.close())  # ... and the agent stops in the same turn of the loop
    done, _ = await asyncio.wait({closing}, timeout=HANG_GUARD_S)
    assert done, "the relay's flusher went on after it was cancelled: close never returned"
    closing.result()


def test_no_loop_in_the_platform_waits_with_wait_for() -> None:
    """Every `asyncio.wait_for` inside a `while` loop of a long-lived task is the hang above waiting to happen."""
    found = []
    tops = ("events", "services", "trainer", "flightdeck")
    for path in sorted(p for top in tops for p in (ROOT / top).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for loop in (n for n in ast.walk(tree) if isinstance(n, ast.While)):
            for node in ast.walk(loop):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait_for"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "asyncio"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], "use `async with asyncio.timeout(...)` in these loops"
