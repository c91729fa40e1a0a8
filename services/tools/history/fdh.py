"""The `.fdh` history file: a job's recorded messages, one JSON object a line, keeping the wire bytes.

Why it works this way: docs/internals.md, "8. Operator tools".
"""

import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import msgspec

from flightdeck.events import subjects
from flightdeck.events.store import Stored, decoded

FORMAT = "flightdeck-history"
VERSION = 1
SUFFIX = ".fdh"


class BadHistoryFile(ValueError):
    """A file that is not a readable Flightdeck history; the message names the file and line."""


class Header(msgspec.Struct, frozen=True, kw_only=True):
    """What a history file holds: written first so a file says what it is."""

    format: str
    version: int
    job_id: str = ""
    exported_at: float = 0.0
    counts: dict[str, int] = {}  # rows per stream: a truncated file is told apart from a short history
    source: str = ""  # where it was exported from (a broker URL, a file)


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded message; `data` is the event's msgpack bytes (base64 in the file)."""

    stream: str
    seq: int
    subject: str
    msg_id: str = ""
    data: bytes


class Recorded(msgspec.Struct, frozen=True, kw_only=True):
    header: Header | None
    rows: list[Stored]


class _Probe(msgspec.Struct):
    """Just enough of a line to tell a header from a row (unknown fields are ignored)."""

    format: str = ""


_encoder = msgspec.json.Encoder()
_row_decoder = msgspec.json.Decoder(Row)
_header_decoder = msgspec.json.Decoder(Header)
_probe_decoder = msgspec.json.Decoder(_Probe)


def header_for(rows: Sequence[Stored], *, job_id: str = "", source: str = "",
               exported_at: float | None = None) -> Header:
    counts: dict[str, int] = {}
    for s in rows:
        counts[s.stream] = counts.get(s.stream, 0) + 1
    return Header(format=FORMAT, version=VERSION, job_id=job_id, counts=counts, source=source,
                  exported_at=time.time() if exported_at is None else exported_at)


def dump(rows: Sequence[Stored], *, job_id: str = "", source: str = "", exported_at: float | None = None,
         header: bool = True) -> Iterator[bytes]:
    """The file's lines (each ending in a newline): the header (unless `header=False`), then every row."""
    if header:
        yield _encoder.encode(header_for(rows, job_id=job_id, source=source, exported_at=exported_at)) + b"\n"
    for s in rows:
        yield _encoder.encode(Row(stream=s.stream, seq=s.seq, subject=s.subject, msg_id=s.msg_id, data=s.data)) + b"\n"


def dumps(rows: Sequence[Stored], *, job_id: str = "", source: str = "", exported_at: float | None = None,
          header: bool = True) -> bytes:
    return b"".join(dump(rows, job_id=job_id, source=source, exported_at=exported_at, header=header))


def parse(data: bytes, name: str = "<bytes>") -> Recorded:
    """Read a whole history file; raise BadHistoryFile naming the first bad line. Events that do not decode
    are kept as undecodable rows (a live service saw them that way too); a bad file structure is not."""
    header: Header | None = None
    rows: list[Stored] = []
    last: dict[str, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        if number == 1 and _probe(line, f"{name}: line 1").format:
            header = _header(line, f"{name}: line 1")
            continue
        row = _row(line, name, number)
        if row.seq <= last.get(row.stream, 0):
            raise BadHistoryFile(f"{name}: line {number}: {row.stream} sequence {row.seq} after {last[row.stream]}; "
                                 "sequences within a stream must increase (rows reordered or duplicated?)")
        last[row.stream] = row.seq
        rows.append(decoded(row.stream, row.seq, row.subject, row.data, row.msg_id))
    if header is not None:
        _check_counts(header, rows, name)
    elif not rows:
        raise BadHistoryFile(f"{name}: no history rows (an empty file?)")
    return Recorded(header=header, rows=rows)


def load(source: Path | str | bytes) -> list[Stored]:
    """The rows of a history file (a path) or of its bytes, in file order."""
    return read(source).rows


def read(source: Path | str | bytes) -> Recorded:
    if isinstance(source, bytes):
        return parse(source)
    path = Path(source)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadHistoryFile(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse(data, str(path))


def write(path: Path, lines: Iterable[bytes]) -> None:
    """Write a history file whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as out:
        for line in lines:
            out.write(line)
    tmp.replace(path)


def _probe(line: bytes, where: str) -> _Probe:
    try:
        return _probe_decoder.decode(line)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: caught first
        raise BadHistoryFile(f"{where}: not a history row or header ({exc})") from None
    except msgspec.DecodeError as exc:
        raise BadHistoryFile(f"{where}: not JSON ({exc}); is this a Flightdeck history (.fdh) file?") from None


def _header(line: bytes, where: str) -> Header:
    try:
        header = _header_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise BadHistoryFile(f"{where}: bad header ({exc})") from None
    if header.format != FORMAT:
        raise BadHistoryFile(f"{where}: format {header.format!r} is not {FORMAT!r}")
    if header.version > VERSION:
        raise BadHistoryFile(f"{where}: {FORMAT} version {header.version} is newer than {VERSION}, the newest this "
                             "flightdeck reads; upgrade flightdeck to read it")
    if header.version < 1:
        raise BadHistoryFile(f"{where}: unknown {FORMAT} version {header.version}")
    return header


# Each stream's subjects are "<prefix>.>": a prefix test is that match, without splitting every subject
_PREFIXES = {stream: subjects.STREAM_SUBJECTS[stream].removesuffix(">") for stream in subjects.HISTORY_STREAMS}


def _row(line: bytes, name: str, number: int) -> Row:
    try:
        row = _row_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise BadHistoryFile(f"{name}: line {number}: bad history row ({exc})") from None
    except msgspec.DecodeError as exc:
        raise BadHistoryFile(f"{name}: line {number}: not JSON ({exc})") from None
    prefix = _PREFIXES.get(row.stream)
    if prefix is None:
        raise BadHistoryFile(f"{name}: line {number}: unknown stream {row.stream!r} (expected one of "
                             f"{', '.join(subjects.HISTORY_STREAMS)})")
    if row.seq < 1:
        raise BadHistoryFile(f"{name}: line {number}: sequence {row.seq} (stream sequences start at 1)")
    if not row.subject.startswith(prefix) or len(row.subject) == len(prefix):
        raise BadHistoryFile(f"{name}: line {number}: subject {row.subject!r} does not belong to stream {row.stream}")
    return row


def _check_counts(header: Header, rows: Sequence[Stored], name: str) -> None:
    found: dict[str, int] = {}
    for s in rows:
        found[s.stream] = found.get(s.stream, 0) + 1
    for stream in sorted(set(header.counts) | set(found)):
        want, have = header.counts.get(stream, 0), found.get(stream, 0)
        if want != have:
            raise BadHistoryFile(f"{name}: the header promises {want} {stream} rows but the file holds {have} "
                                 "(a truncated or edited file?)")
