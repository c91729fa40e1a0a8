"""Telemetry read ahead of the ticks that fold it.

A service folds telemetry only when one of its own ClockTicks comes back, up to the position the tick
recorded. The tap follows FD_TELEMETRY (an ordered consumer from the last folded position + 1) into a
bounded buffer; a tick asking for more than the buffer holds (after a restart, or past the bound) is
served from the store, so memory stays bounded and nothing is skipped.
"""

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence

import structlog

from events.store import EventStore, Stored
from events.subjects import TELEMETRY

log = structlog.get_logger("flightdeck.shell")


class TelemetryTap:
    def __init__(self, store: EventStore, patterns: Sequence[str], *, limit: int = 100_000) -> None:
        self.store, self.patterns, self.limit = store, tuple(patterns), limit
        self.items: deque[Stored] = deque()
        self.seen = 0  # highest sequence received: what a tick records
        self.complete = 0  # every matching message up to here is buffered or already folded
        self._task: asyncio.Task[None] | None = None

    def start(self, folded: int) -> None:
        self.seen = self.complete = folded
        if self.patterns:
            self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def offer(self, stored: Stored) -> None:
        if stored.seq <= self.seen:
            return
        if self.complete == self.seen and len(self.items) < self.limit:
            self.items.append(stored)
            self.complete = stored.seq
        self.seen = stored.seq

    async def take(self, after: int, upto: int) -> list[Stored]:
        """The matching messages with `after < seq <= upto`, in order; the buffer forgets them. If reading
        the store fails, nothing is forgotten, so the call can simply be retried."""
        start = max(self.complete, after) + 1  # below this the buffer has everything; from it, the store
        fetched: list[Stored] = []
        if start <= upto:
            async for batch in self.store.read(TELEMETRY, self.patterns, from_seq=start, until_seq=upto):
                fetched.extend(s for s in batch if s.seq <= upto)
        taken: list[Stored] = []
        while self.items and self.items[0].seq <= upto:
            item = self.items.popleft()
            if after < item.seq < start:  # later ones arrived while reading and are in `fetched`
                taken.append(item)
        if start <= upto:
            self.complete = max(self.complete, upto)
            self.seen = max(self.seen, upto)
        return taken + fetched

    async def _follow(self) -> None:
        delay = 0.1
        while True:
            try:
                async for stored in self.store.follow(TELEMETRY, self.patterns, from_seq=self.seen + 1):
                    self.offer(stored)
                    delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker went away: follow again from what we have
                log.warning("telemetry follow failed; retrying", error=repr(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
