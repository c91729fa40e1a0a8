"""Telemetry read ahead of the ticks that fold it.

Why it works this way: docs/internals.md, "2. Cores and the shell".
"""

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence

import structlog

from flightdeck.events.store import EventStore, Stored
from flightdeck.events.subjects import TELEMETRY

log = structlog.get_logger("flightdeck.shell")

STALL_S = 1.0  # a healthy feed delivers within milliseconds; one that lags the store this long is restarted


class TelemetryTap:
    def __init__(self, store: EventStore, patterns: Sequence[str], *, limit: int = 100_000,
                 stall_s: float = STALL_S, prompt_types: frozenset[str] = frozenset()) -> None:
        self.store, self.patterns, self.limit, self.stall_s = store, tuple(patterns), limit, stall_s
        self.prompt_types = prompt_types
        self.prompted = asyncio.Event()  # set when a message of one of `prompt_types` arrives
        self.items: deque[Stored] = deque()
        self.seen = 0  # highest sequence received (or read from the store): a position never goes below it
        self.complete = 0  # every matching message up to here is buffered or already folded
        self.fed = 0  # highest sequence the current feed itself delivered
        self.owed = 0  # highest sequence the store had to supply that the feed has not delivered yet
        self.owed_since = 0.0  # monotonic time the store first supplied something the feed still owes
        self.restarts = 0  # feeds started again because they fell behind the store
        self._task: asyncio.Task[None] | None = None
        self._retired: set[asyncio.Task[None]] = set()

    def start(self, folded: int) -> None:
        self.seen = self.complete = folded
        self._feed()

    def _feed(self) -> None:
        if self.patterns:
            self.fed, self.owed = self.seen, 0
            self._task = asyncio.create_task(self._follow(self.seen + 1))

    def _restart(self) -> None:
        """Start the feed again past everything buffered or folded. The old one is cancelled, not awaited: its
        consumer's deletion may wait on the broker, and what it still delivers is ignored or in order anyway."""
        if self._task is not None:
            self._task.cancel()
            self._retired.add(self._task)
            self._task.add_done_callback(self._retired.discard)
        self.restarts += 1
        self._feed()

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._retired) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def position(self) -> int:
        """What a tick taken now records: the stream's last sequence (never below what was received). Every
        message stored before this call is at or below it. Raises what the store raises when it cannot tell."""
        return max(await self.store.last_seq(TELEMETRY), self.seen)

    def offer(self, stored: Stored) -> None:
        """A message from a feed. Each feed delivers every matching message from where it started, in order, so
        whatever is at or below `seen` is here already (buffered, folded, or read from the store)."""
        self.fed = max(self.fed, stored.seq)
        if stored.seq <= self.seen:
            return
        if self.complete == self.seen and len(self.items) < self.limit:
            self.items.append(stored)
            self.complete = stored.seq
        self.seen = stored.seq
        if self.prompt_types and stored.subject.rsplit(".", 1)[-1] in self.prompt_types:
            self.prompted.set()

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
        if self.owed > self.fed and time.monotonic() - self.owed_since >= self.stall_s:
            log.info("telemetry feed behind the stream; following again", fed_seq=self.fed, owed_seq=self.owed,
                     from_seq=self.seen + 1)
            self._restart()  # past everything taken now
        elif fetched and fetched[-1].seq > self.fed:  # the feed owes these: it should deliver them within stall_s
            if self.owed <= self.fed:
                self.owed_since = time.monotonic()
            self.owed = max(self.owed, fetched[-1].seq)
        return taken + fetched

    async def _follow(self, from_seq: int) -> None:
        delay = 0.1
        while True:
            try:
                async for stored in self.store.follow(TELEMETRY, self.patterns, from_seq=from_seq):
                    self.offer(stored)
                    delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker went away: follow again past what we have
                log.warning("telemetry follow failed; retrying", error=repr(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            from_seq = self.seen + 1
            self.fed = max(self.fed, self.seen)  # nothing at or below `seen` is owed any more
