"""Closing the parts of a stopping agent, each within a bound: a part that hangs is named in the log and left to
die with the process, so the agent still stops (its exit is what `flightdeck down`, systemd or a test waits for).

Why: a suite run once saw an agent record its ranks' exits and then never exit, with nothing in its log to say
which part it was waiting for. The bound makes that a logged error instead of a hung node, and the log says
where the part was waiting (`awaiting`), so the next one can be fixed."""

import asyncio
from collections.abc import Awaitable

import structlog

from flightdeck.services.shell.stacks import awaiting_chain

log = structlog.get_logger("flightdeck.agent")

CLOSE_WITHIN_S = 20.0


async def close_within(part: str, closing: Awaitable[object], within_s: float = CLOSE_WITHIN_S) -> None:
    """Await `closing` for at most `within_s`; past that, log `part` as not closed, cancel it and return. Not
    `asyncio.wait_for`: on a timeout it waits for the cancel without a bound (docs/internals.md, nats-py)."""
    task = asyncio.ensure_future(closing)
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        awaiting = awaiting_chain(task)
        task.cancel()
        log.error("a part did not close in time; the agent stops without it", part=part, within_s=within_s,
                  awaiting=awaiting)
        return
    task.result()
