"""The .fdh history file: round trips keep every recorded byte and sequence; bad files say which line is bad
and import nothing; the read-only store serves rows at their recorded sequences."""

import base64
import json
from pathlib import Path

import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.job import JobQueued
from flightdeck.events.store import Stored, decoded
from flightdeck.services.tools.history import fdh, library
from flightdeck.services.tools.history.recorded import ReadOnlyHistory, RecordedStore

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "spike.fdh.jsonl"
JOB = "spike-000001"


def key(rows: list[Stored]) -> list[tuple[str, int, str, str, bytes]]:
    return [(s.stream, s.seq, s.subject, s.msg_id, s.data) for s in rows]


def test_a_headerless_recorded_drill_loads_with_every_event_decoded() -> None:
    recorded = fdh.read(FIXTURE)
    assert recorded.header is None
    assert len(recorded.rows) == len(FIXTURE.read_bytes().splitlines())
    assert all(s.event is not None for s in recorded.rows)
    first = json.loads(FIXTURE.read_bytes().splitlines()[0])
    assert (recorded.rows[0].seq, recorded.rows[0].msg_id) == (first["seq"], first["msg_id"])
    assert recorded.rows[0].data == base64.b64decode(first["data"])


def test_export_then_import_gives_back_the_same_rows_and_a_header(tmp_path: Path) -> None:
    rows = fdh.load(FIXTURE)
    data = fdh.dumps(rows, job_id=JOB, source="nats://example:4222", exported_at=1000.0)
    header = json.loads(data.splitlines()[0])
    assert header["format"] == fdh.FORMAT and header["version"] == fdh.VERSION and header["job_id"] == JOB
    assert sum(header["counts"].values()) == len(rows)
    (tmp_path / "job.fdh").write_bytes(data)
    history, kept = library.import_file(tmp_path / "job.fdh", tmp_path / "data")
    assert kept == tmp_path / "data" / "histories" / f"{JOB}.fdh"
    assert history.job_id == JOB and key(history.rows) == key(rows)
    assert key(fdh.load(kept)) == key(rows)
    assert fdh.dumps(fdh.load(kept), job_id=JOB, source="nats://example:4222", exported_at=1000.0) == data


def _lines() -> list[bytes]:
    return FIXTURE.read_bytes().splitlines()


def _with_line(index: int, line: bytes) -> bytes:
    lines = _lines()
    lines[index] = line
    return b"\n".join(lines) + b"\n"


def _row(index: int, **changes: object) -> bytes:
    row = json.loads(_lines()[index])
    row.update(changes)
    return json.dumps(row).encode()


@pytest.mark.parametrize(("data", "says"), [
    (_with_line(4, b"{not json"), "line 5: not JSON"),
    (_with_line(7, _row(7, data="!!!not base64")), "line 8: bad history row"),
    (_with_line(9, _row(9, seq=3)), "line 10: FD_CONTROL sequence 3 after 9"),
    (_with_line(2, _row(2, stream="FD_OTHER")), "line 3: unknown stream 'FD_OTHER'"),
    (_with_line(2, _row(2, subject="fd.tel.x.0.Heartbeat")), "line 3: subject 'fd.tel.x.0.Heartbeat' does not"),
    (_with_line(3, _row(3, seq="four")), "line 4: bad history row"),
    (b'{"format": "flightdeck-history", "version": 2}\n' + _lines()[0], "line 1: flightdeck-history version 2 is "
     "newer than 1"),
    (b'{"format": "something-else", "version": 1}\n' + _lines()[0], "line 1: format 'something-else'"),
    (b'{"format": "flightdeck-history", "version": 1, "counts": {"FD_CONTROL": 2}}\n' + _lines()[0],
     "promises 2 FD_CONTROL rows but the file holds 1"),
    (b"\n", "no history rows"),
])
def test_a_bad_file_names_its_line_and_imports_nothing(tmp_path: Path, data: bytes, says: str) -> None:
    path = tmp_path / "bad.fdh"
    path.write_bytes(data)
    with pytest.raises(fdh.BadHistoryFile) as caught:
        fdh.load(path)
    assert str(caught.value).startswith(f"{path}: ") and says in str(caught.value), str(caught.value)
    with pytest.raises(library.BadHistory):
        library.import_file(path, tmp_path / "data")
    assert not (tmp_path / "data" / "histories").exists() or not any((tmp_path / "data" / "histories").iterdir())


def test_an_undecodable_event_is_kept_as_the_live_service_saw_it() -> None:
    rows = fdh.load(_with_line(0, _row(0, data=base64.b64encode(b"\x01\x02").decode())))
    assert rows[0].event is None and rows[0].error
    assert all(s.event is not None for s in rows[1:])


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(fdh.BadHistoryFile, match="cannot read"):
        fdh.load(tmp_path / "nowhere.fdh")


def _stored(stream: str, seq: int, subject: str, event: object) -> Stored:
    return decoded(stream, seq, subject, codec.encode(event), f"m{seq}")  # type: ignore[arg-type]


async def test_the_recorded_store_keeps_sequences_with_gaps_and_filters() -> None:
    q = JobQueued(job_id="a", priority=0, occurred_at=1.0)
    tick = ClockTick(service="health", now=2.0, positions={subjects.TELEMETRY: 40})
    rows = [_stored(subjects.CONTROL, 5, "fd.ctl.job.a.JobQueued", q),
            _stored(subjects.CONTROL, 9, "fd.ctl.clock.health", tick),
            _stored(subjects.CONTROL, 12, "fd.ctl.job.a.JobQueued", q)]
    store = RecordedStore(rows, batch=2)
    got = [b async for b in store.read(subjects.CONTROL)]
    assert [[s.seq for s in b] for b in got] == [[5, 9], [12]]
    assert [s.seq async for b in store.read(subjects.CONTROL, ["fd.ctl.job.>"], from_seq=6) for s in b] == [12]
    assert [s.seq async for b in store.read(subjects.CONTROL, until_seq=11) for s in b] == [5, 9]
    assert [s.seq async for b in store.read(subjects.TELEMETRY) for s in b] == []
    assert await store.last_seq(subjects.CONTROL) == 12 and await store.last_seq(subjects.DEAD) == 0
    last = await store.last(subjects.CONTROL, "fd.ctl.clock.>")
    assert last is not None and last.seq == 9
    with pytest.raises(ReadOnlyHistory):
        await store.append("fd.ctl.job.a.JobQueued", q)
