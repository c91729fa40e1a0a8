"""The event store: a small protocol, the records it returns, and an in-memory implementation.

The same contract suite (tests/contract) runs against this store and the JetStream one.
"""

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.subjects import STREAM_SUBJECTS, matches, matches_any, stream_of

DEDUP_WINDOW_S = 120.0  # the JetStream default duplicate window


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored message. `event` is None when the bytes did not decode; `error` then says why."""

    stream: str
    seq: int
    subject: str
    data: bytes
    msg_id: str
    event: Event | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class AppendResult:
    stream: str
    seq: int
    duplicate: bool  # the msg id was already stored: nothing new was written


class ConcurrencyConflict(Exception):
    """An append fenced on `fence` expected its last sequence to be `expected`, but it was `actual`."""

    def __init__(self, fence: str, expected: int, actual: int) -> None:
        super().__init__(f"{fence}: expected last sequence {expected}, found {actual}")
        self.fence, self.expected, self.actual = fence, expected, actual


class StoreUnavailable(Exception):
    """The broker could not be reached or did not answer in time. An append that raised this may still
    land (the client flushes what it buffered once reconnected): retry it with the same msg id."""


class EventStore(Protocol):
    async def append(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str = "",
        expected_last_seq: int | None = None,
        fence: str = "",
    ) -> AppendResult:
        """Store `event` under `subject`. `msg_id` de-duplicates (default: the event id). With
        `expected_last_seq`, append only if the last message on `fence` (default `subject`, may be a
        wildcard) has that sequence (0: none); else raise ConcurrencyConflict."""

    async def append_bytes(self, subject: str, data: bytes, *, msg_id: str = "", expected_last_seq: int | None = None,
                           fence: str = "") -> AppendResult:
        """`append` for bytes already encoded (a service's state snapshot is not an event)."""

    async def append_batch(self, items: Sequence[tuple[str, Event]]) -> list[AppendResult]:
        """Store many unfenced events, pipelined; results in the same order."""

    def read(
        self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1, until_seq: int = 0
    ) -> AsyncIterator[list[Stored]]:
        """The stored messages from `from_seq` up to `until_seq` (0: the end at the time of the
        call), filtered by `subjects` (empty: all), in order, in batches."""

    def follow(
        self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1
    ) -> AsyncIterator[Stored]:
        """Like read, then every new message as it arrives; never ends by itself."""

    async def last(self, stream: str, subject: str) -> Stored | None:
        """The newest message on `subject` (may be a wildcard), or None."""

    async def last_seq(self, stream: str) -> int:
        """The stream's last sequence (0 when empty)."""

    async def bounds(self, stream: str) -> tuple[int, float, int]:
        """(first sequence still stored, its event's time, last sequence): what a stream that ages out still
        holds. An empty stream: (last + 1, inf, last)."""


def decoded(stream: str, seq: int, subject: str, data: bytes, msg_id: str) -> Stored:
    try:
        return Stored(stream, seq, subject, data, msg_id, codec.admit(data))
    except codec.UndecodableEvent as exc:
        return Stored(stream, seq, subject, data, msg_id, None, str(exc))


def _filtered(subject: str, subjects: tuple[str, ...]) -> bool:
    return not subjects or matches_any(subjects, subject)


class MemoryStore:
    """An in-memory EventStore with JetStream's semantics: per-stream sequences and de-duplication."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, batch: int = 512) -> None:
        self._clock = clock
        self._batch = batch
        self._streams: dict[str, list[Stored]] = {name: [] for name in STREAM_SUBJECTS}
        self._seen: dict[str, dict[str, tuple[float, int]]] = {name: {} for name in STREAM_SUBJECTS}
        self._changed = asyncio.Condition()
        self._first: dict[str, int] = {name: 1 for name in STREAM_SUBJECTS}  # below it: aged out (`age_out`)

    async def append(
        self,
        subject: str,
        event: Event,
        *,
        msg_id: str = "",
        expected_last_seq: int | None = None,
        fence: str = "",
    ) -> AppendResult:
        return await self.append_bytes(subject, codec.encode(event), msg_id=msg_id or event.event_id,
                                       expected_last_seq=expected_last_seq, fence=fence)

    async def append_bytes(
        self, subject: str, data: bytes, *, msg_id: str = "", expected_last_seq: int | None = None, fence: str = ""
    ) -> AppendResult:
        """`append` for bytes already encoded (or, in tests, deliberately not an event)."""
        stream = stream_of(subject)
        now = self._clock()
        # Like JetStream: the fence is checked before the msg id, so a fenced retry whose first try
        # landed and was then followed by another append is a conflict, not a duplicate.
        if expected_last_seq is not None:
            last = await self.last(stream, fence or subject)
            actual = last.seq if last else 0
            if actual != expected_last_seq:
                if last is not None and msg_id and last.msg_id == msg_id:
                    return AppendResult(stream, last.seq, True)  # an earlier try of this append landed
                raise ConcurrencyConflict(fence or subject, expected_last_seq, actual)
        seen = self._seen[stream]
        if msg_id and msg_id in seen and now - seen[msg_id][0] < DEDUP_WINDOW_S:
            return AppendResult(stream, seen[msg_id][1], True)
        messages = self._streams[stream]
        seq = len(messages) + 1
        messages.append(decoded(stream, seq, subject, data, msg_id))
        if msg_id:
            seen[msg_id] = (now, seq)
        async with self._changed:
            self._changed.notify_all()
        return AppendResult(stream, seq, False)

    async def append_batch(self, items: Sequence[tuple[str, Event]]) -> list[AppendResult]:
        return [await self.append(subject, event) for subject, event in items]

    async def read(
        self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1, until_seq: int = 0
    ) -> AsyncIterator[list[Stored]]:
        messages = self._streams[stream]
        end = min(until_seq or len(messages), len(messages))
        batch: list[Stored] = []
        wanted = tuple(subjects)
        for stored in messages[max(from_seq, self._first[stream]) - 1 : end]:
            if _filtered(stored.subject, wanted):
                batch.append(stored)
                if len(batch) >= self._batch:
                    yield batch
                    batch = []
        if batch:
            yield batch

    async def follow(
        self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1
    ) -> AsyncIterator[Stored]:
        messages = self._streams[stream]
        nxt = max(from_seq, self._first[stream])
        wanted = tuple(subjects)
        while True:
            while nxt <= len(messages):
                stored = messages[nxt - 1]
                nxt += 1
                if _filtered(stored.subject, wanted):
                    yield stored
            async with self._changed:
                while len(messages) < nxt:
                    await self._changed.wait()

    def rows(self, stream: str) -> list[Stored]:
        """The stream's messages in order, as stored (the list itself: it grows with every append)."""
        return self._streams[stream]

    async def last(self, stream: str, subject: str) -> Stored | None:
        for stored in reversed(self._streams[stream]):
            if matches(subject, stored.subject):
                return stored
        return None

    async def last_seq(self, stream: str) -> int:
        return len(self._streams[stream])

    async def bounds(self, stream: str) -> tuple[int, float, int]:
        first, last = self._first[stream], len(self._streams[stream])
        if first > last:
            return first, float("inf"), last
        ev = self._streams[stream][first - 1].event
        return first, ev.occurred_at if ev is not None else 0.0, last

    def view(self) -> "MemoryStore":
        """The same streams, read from positions of its own: what ages out of the view stays in this store (the
        fault explorer ages telemetry out for the archiver and the history's readers, while the services and the
        replays that check them read it whole, as they read it days before its limits dropped it)."""
        other = copy.copy(self)
        other._first = dict(self._first)
        return other

    def age_out(self, stream: str, through_seq: int) -> None:
        """Drop the stream's messages up to `through_seq`, as a stream's limits do (DiscardPolicy.OLD)."""
        self._first[stream] = max(self._first[stream], min(through_seq, len(self._streams[stream])) + 1)
