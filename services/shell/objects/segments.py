"""Archived history segments: one job's messages of one aged-out stream (telemetry or output) over a sequence
range, stored in the object store as they were stored in the stream, so a reader gets back the same bytes at the
same sequences. A segment is checked against the HistoryArchived event that records it (hash, count, range)
before any of it is read.

Why it works this way: docs/internals.md, "9. The whole history".
"""

import hashlib
import zlib

import msgspec

from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.store import Stored, decoded

FORMAT = 1
LEVEL = 6  # zlib: telemetry is repetitive msgpack, ~4-8x smaller; faster levels gain little here


class Message(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    subject: str
    data: bytes
    msg_id: str = ""


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    format: int = FORMAT
    job_id: str
    stream: str
    first_seq: int
    last_seq: int
    messages: list[Message]


class BadSegment(ValueError):
    """A stored segment that is not what its record says (hash, count, range, job) or does not decode."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Segment)


ARCHIVED = (subjects.TELEMETRY, subjects.LOGS)  # the streams that age out


def job_filter(job_id: str, stream: str) -> str:
    """The subjects of one job's messages in an archived stream."""
    return subjects.telemetry_job(job_id) if stream == subjects.TELEMETRY else subjects.logs_filter(job_id)


def key(job_id: str, stream: str, first_seq: int, last_seq: int) -> str:
    return f"history/{job_id}/{stream}/{first_seq:015d}-{last_seq:015d}.seg"


def encode(segment: Segment) -> tuple[bytes, str]:
    """The stored bytes and their sha256."""
    data = zlib.compress(_encoder.encode(segment), LEVEL)
    return data, hashlib.sha256(data).hexdigest()


def decode(data: bytes, record: HistoryArchived) -> list[Stored]:
    """The segment's messages as stored rows, after checking it against `record`; raises BadSegment."""
    where = f"segment {record.key} of {record.job_id}"
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise BadSegment(f"{where}: its sha256 is not the one recorded (corrupt or replaced)")
    try:
        seg = _decoder.decode(zlib.decompress(data))
    except (zlib.error, msgspec.DecodeError) as exc:
        raise BadSegment(f"{where}: does not decode: {exc}") from None
    if seg.format != FORMAT:
        raise BadSegment(f"{where}: format {seg.format}, this reader knows {FORMAT}")
    if (seg.job_id, seg.stream, seg.first_seq, seg.last_seq) != (record.job_id, record.stream, record.first_seq,
                                                                 record.last_seq):
        raise BadSegment(f"{where}: holds {seg.job_id} {seg.stream} {seg.first_seq}..{seg.last_seq}, "
                         f"recorded as {record.stream} {record.first_seq}..{record.last_seq}")
    if len(seg.messages) != record.count:
        raise BadSegment(f"{where}: {len(seg.messages)} messages, {record.count} recorded")
    last = seg.first_seq - 1
    for m in seg.messages:
        if not last < m.seq <= seg.last_seq:
            raise BadSegment(f"{where}: sequence {m.seq} out of order or outside its range")
        if subjects.job_of(m.subject) != seg.job_id or not subjects.matches(job_filter(seg.job_id, seg.stream),
                                                                             m.subject):
            raise BadSegment(f"{where}: message {m.seq} on {m.subject!r} is not the job's")
        last = m.seq
    return [decoded(seg.stream, m.seq, m.subject, m.data, m.msg_id) for m in seg.messages]
