"""An archived segment gives back the stored bytes at their sequences, and only after it matches its record: a
segment altered, cut short, moved to another range or holding another job's messages is refused by name."""

import msgspec
import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell.objects import segments


def message(seq: int, job: str = "j", step: int = 0) -> segments.Message:
    ev = StepCompleted(job_id=job, rank=0, attempt=0, node="n1", step=step, loss=1.0, grad_norm=1.0, lr=1e-3,
                       tokens_per_s=1.0, step_time_s=0.1, event_id=f"s{seq}", occurred_at=float(seq))
    return segments.Message(seq, subjects.telemetry(job, 0, "StepCompleted"), codec.encode(ev), f"s{seq}")


def stored(msgs: list[segments.Message], first: int = 1, last: int = 20,
           job: str = "j") -> tuple[bytes, HistoryArchived]:
    seg = segments.Segment(job_id=job, stream=subjects.TELEMETRY, first_seq=first, last_seq=last, messages=msgs)
    data, sha = segments.encode(seg)
    rec = HistoryArchived(job_id="j", stream=subjects.TELEMETRY, first_seq=first, last_seq=last, count=len(msgs),
                          bytes=len(data), sha256=sha, key=segments.key("j", subjects.TELEMETRY, first, last))
    return data, rec


def test_a_segment_reads_back_the_same_bytes_at_the_same_sequences() -> None:
    msgs = [message(3, step=0), message(7, step=1), message(20, step=2)]
    data, rec = stored(msgs)
    rows = segments.decode(data, rec)
    assert [(r.stream, r.seq, r.subject, r.data, r.msg_id) for r in rows] == \
        [(subjects.TELEMETRY, m.seq, m.subject, m.data, m.msg_id) for m in msgs]
    assert [r.event.step for r in rows if isinstance(r.event, StepCompleted)] == [0, 1, 2]


def test_a_segment_unlike_its_record_is_refused_by_name() -> None:
    data, rec = stored([message(3), message(7)])
    with pytest.raises(segments.BadSegment, match="sha256 is not the one recorded"):
        segments.decode(data[:-1] + bytes([data[-1] ^ 1]), rec)
    with pytest.raises(segments.BadSegment, match="2 messages, 3 recorded"):
        segments.decode(data, msgspec.structs.replace(rec, count=3))
    with pytest.raises(segments.BadSegment, match=r"recorded as FD_TELEMETRY 1\.\.30"):
        segments.decode(data, msgspec.structs.replace(rec, last_seq=30))
    other, other_rec = stored([message(3, job="k")])
    with pytest.raises(segments.BadSegment, match="not the job's"):
        segments.decode(other, other_rec)
    late, late_rec = stored([message(7), message(3)])
    with pytest.raises(segments.BadSegment, match="out of order"):
        segments.decode(late, late_rec)
