"""A read-only EventStore over recorded messages that keeps their recorded stream sequences.

A broker numbers what it stores itself, so an imported history cannot be put back into one at its old
sequences. Decision msg ids embed input sequences (`scheduler:FD_CONTROL:48:0`) and clock ticks record
telemetry positions, so `services.shell.fold.replay(service, RecordedStore(rows))` must see the recorded ones:
this store serves them as they were, gaps and all.
"""

import asyncio
import bisect
from collections.abc import AsyncIterator, Iterable, Sequence

from flightdeck.events.base import Event
from flightdeck.events.store import AppendResult, Stored
from flightdeck.events.subjects import STREAM_SUBJECTS, matches

BATCH = 4096


class ReadOnlyHistory(Exception):
    """An append to a recorded history: what happened cannot be added to."""


class RecordedStore:
    """The EventStore protocol over `rows` (any order across streams; within a stream, increasing seq)."""

    def __init__(self, rows: Iterable[Stored], *, batch: int = BATCH) -> None:
        self._batch = batch
        self._streams: dict[str, list[Stored]] = {name: [] for name in STREAM_SUBJECTS}
        for s in rows:
            kept = self._streams.setdefault(s.stream, [])
            assert not kept or kept[-1].seq < s.seq, (s.stream, s.seq)
            kept.append(s)
        self._seqs = {name: [s.seq for s in kept] for name, kept in self._streams.items()}

    def rows(self, stream: str) -> list[Stored]:
        """The stream's recorded messages, in order (the store's own list: do not change it)."""
        return self._streams.get(stream, [])

    async def append(self, subject: str, event: Event, *, msg_id: str = "", expected_last_seq: int | None = None,
                     fence: str = "") -> AppendResult:
        raise ReadOnlyHistory(f"cannot append {type(event).__name__} to {subject}: a recorded history is read-only")

    async def append_bytes(self, subject: str, data: bytes, *, msg_id: str = "", expected_last_seq: int | None = None,
                           fence: str = "") -> AppendResult:
        raise ReadOnlyHistory(f"cannot append to {subject}: a recorded history is read-only")

    async def append_batch(self, items: Sequence[tuple[str, Event]]) -> list[AppendResult]:
        raise ReadOnlyHistory("cannot append to a recorded history: it is read-only")

    async def read(self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1,
                   until_seq: int = 0) -> AsyncIterator[list[Stored]]:
        kept, seqs = self._streams.get(stream, []), self._seqs.get(stream, [])
        start = bisect.bisect_left(seqs, max(from_seq, 1))
        end = bisect.bisect_right(seqs, until_seq) if until_seq else len(kept)
        patterns = list(subjects)
        for i in range(start, end, self._batch):
            chunk = kept[i : min(i + self._batch, end)]
            if patterns:
                chunk = [s for s in chunk if any(matches(p, s.subject) for p in patterns)]
            if chunk:
                yield chunk

    async def follow(self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1) -> AsyncIterator[Stored]:
        async for batch in self.read(stream, subjects, from_seq=from_seq):
            for stored in batch:
                yield stored
        await asyncio.Event().wait()  # a recorded history never grows: following it waits forever, as promised

    async def last(self, stream: str, subject: str) -> Stored | None:
        for stored in reversed(self._streams.get(stream, [])):
            if matches(subject, stored.subject):
                return stored
        return None

    async def last_seq(self, stream: str) -> int:
        seqs = self._seqs.get(stream, [])
        return seqs[-1] if seqs else 0

    async def bounds(self, stream: str) -> tuple[int, float, int]:
        """A recorded history holds what was read: its telemetry starts where the record does (its gaps are in
        the History that came with it)."""
        kept = self._streams.get(stream, [])
        if not kept:
            return 1, float("inf"), 0
        ev = kept[0].event
        return kept[0].seq, ev.occurred_at if ev is not None else 0.0, kept[-1].seq
