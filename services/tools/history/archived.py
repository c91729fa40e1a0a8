"""A job's telemetry and output as one sequence: the segments the archiver stored (HistoryArchived, checked
against their records) followed by what the live stream still holds after them. Where messages may be missing
(aged out before they were archived, or a segment that cannot be read) the range is returned as a Gap, so the
readers report it as such and never as a divergence.

Why it works this way: docs/internals.md, "9. The whole history".
"""

from dataclasses import dataclass

from flightdeck.events.archive import HistoryArchived
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.shell.objects import segments
from flightdeck.services.shell.objects.store import ObjectStore

AGED_OUT = "aged out of the stream before it was archived"


@dataclass(frozen=True, slots=True)
class Gap:
    """Stream sequences `from_seq`..`to_seq` (`from_seq` 0: from the job's start) where the job's messages, if it
    had any there, are missing from its history, and why."""

    stream: str
    from_seq: int
    to_seq: int
    why: str

    def __str__(self) -> str:
        start = "the job's start" if self.from_seq == 0 else str(self.from_seq)
        return f"{self.stream} sequences {start} to {self.to_seq}: {self.why}"


def recorded_gaps(records: list[HistoryArchived]) -> list[Gap]:
    """What the archiver found gone when it read (the part of the gaps a history file still says)."""
    return [Gap(r.stream, r.lost_from, r.lost_to, AGED_OUT) for r in sorted(records, key=lambda r: r.first_seq)
            if r.lost_to > 0]


async def _segments(objects: ObjectStore | None, records: list[HistoryArchived],
                    unreadable: str) -> tuple[dict[int, Stored], list[tuple[int, int, str]], int]:
    """The archived rows by sequence, the ranges of segments that cannot be read (with why), and the last
    sequence the records cover."""
    rows: dict[int, Stored] = {}
    bad: list[tuple[int, int, str]] = []
    through = 0
    for rec in sorted(records, key=lambda r: (r.first_seq, r.last_seq)):
        if rec.last_seq > through:  # else a segment asked twice (its first record came late): the same messages
            try:
                if objects is None:
                    raise segments.BadSegment(unreadable)
                rows.update((r.seq, r) for r in segments.decode(await objects.get_bytes(rec.key), rec))
            except Exception as exc:  # missing, corrupt, store down: the stream may still hold it, else a gap
                bad.append((max(rec.first_seq, through + 1), rec.last_seq, f"archived segment {rec.key}: {exc}"))
        through = max(through, rec.last_seq)
    return rows, bad, through


async def stream_rows(events: EventStore, objects: ObjectStore | None, job_id: str, stream: str,
                      records: list[HistoryArchived], submitted_at: float, *,
                      unreadable: str = "no object store to read it from",
                      from_seq: int = 1) -> tuple[list[Stored], list[Gap]]:
    """The job's messages in `stream`, archived then live, and the gaps between or within them; from `from_seq`
    on (a verify going on from an earlier one's mark), the segments wholly before it unread."""
    records = [r for r in records if r.last_seq >= from_seq]
    rows, bad, through = await _segments(objects, records, unreadable)
    gaps = recorded_gaps(records)
    final = any(r.final for r in records)
    first, first_at, last = await events.bounds(stream)
    for lo, hi, why in bad:  # what the stream no longer holds of an unreadable segment is missing
        if lo < first:
            gaps.append(Gap(stream, lo, min(hi, first - 1), why))
    if records and not final and first > through + 1:
        gaps.append(Gap(stream, through + 1, first - 1, AGED_OUT))
    elif not records and first > 1 and first_at > submitted_at:
        gaps.append(Gap(stream, 0, first - 1, AGED_OUT))
    start = max(min([through + 1, *(lo for lo, _, _ in bad)]), first, from_seq)
    end = min(last, through) if final else last  # nothing of the job comes after its final segment
    if end >= start:
        async for batch in events.read(stream, [segments.job_filter(job_id, stream)], from_seq=start, until_seq=end):
            rows.update((r.seq, r) for r in batch if r.seq not in rows)
    if from_seq > 1:
        gaps = [Gap(g.stream, max(g.from_seq, from_seq), g.to_seq, g.why) for g in gaps if g.to_seq >= from_seq]
    return [rows[seq] for seq in sorted(rows) if seq >= from_seq], sorted(gaps, key=lambda g: g.from_seq)
