"""Where a job's history comes from: a file, the data dir's library of imported histories, or the broker.

`flightdeck import job.fdh` keeps the file as `<data-dir>/histories/<job>.fdh`: a broker numbers what it
stores itself and could not re-create the recorded sequences that decision ids and clock ticks refer to.
Every verb that reads a history (replay, postmortem, verify, whatif, export) calls `open_history`: a JOB
resolves to an imported history first, else to the live broker; `from_file` reads a file directly.
"""

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from flightdeck.events import subjects
from flightdeck.events.admission import Admission
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.store import Stored
from flightdeck.events.subjects import InvalidSubjectToken
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.shell.objects.open import objects_url as default_objects_url
from flightdeck.services.shell.objects.open import open_store as open_objects
from flightdeck.services.shell.objects.store import ObjectStore
from flightdeck.services.tools.cli import EXIT_NOT_FOUND, UserError
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.archived import Gap, recorded_gaps
from flightdeck.services.tools.history.read import JobNotFound, job_history
from flightdeck.services.tools.history.recorded import RecordedStore

DEFAULT_DATA_DIR = ".flightdeck"  # what `flightdeck up` uses (services/tools/console/up.py)
LIBRARY = "histories"


class HistoryNotFound(UserError):
    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_NOT_FOUND)


class BadHistory(UserError):
    """A history file that cannot be read (fdh.BadHistoryFile), as a one-line CLI error."""


@dataclass(frozen=True)
class History:
    """One job's recorded history: `rows` in stream order (FD_CONTROL, FD_TELEMETRY, FD_DEAD), `store` the
    read-only EventStore over them at their recorded sequences, `source` where they came from (for output)."""

    job_id: str
    rows: list[Stored]
    source: str
    header: fdh.Header | None = None
    gaps: tuple[Gap, ...] = ()  # where its telemetry or output may be missing (history/archived.py)
    store: RecordedStore = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", RecordedStore(self.rows))

    def stream(self, name: str) -> list[Stored]:
        """The rows of one stream, in order."""
        return self.store.rows(name)

    def job_control(self) -> list[Stored]:
        """The job's own control history (`fd.ctl.job.<job>.*`) as the services admit it (events/admission.py):
        in order, without what they refused. An event this code cannot decode is kept (check_contiguous counts a
        newer writer's)."""
        prefix = f"fd.ctl.job.{self.job_id}."
        admission = Admission()
        return [s for s in self.stream(subjects.CONTROL)
                if s.subject.startswith(prefix) and (s.event is None or not admission.refusal(s))]


def data_dir_of(explicit: Path | str | None = None) -> Path:
    """--data-dir, else $FLIGHTDECK_DATA_DIR (set for processes `flightdeck up` starts), else ./.flightdeck."""
    return Path(explicit or os.environ.get("FLIGHTDECK_DATA_DIR") or DEFAULT_DATA_DIR)


def library_path(data_dir: Path | str | None, job_id: str) -> Path:
    return data_dir_of(data_dir) / LIBRARY / f"{subjects.token(job_id)}{fdh.SUFFIX}"


def jobs_in(rows: list[Stored]) -> list[str]:
    """Job ids with a control history among `rows`, in order of first appearance."""
    seen: dict[str, None] = {}
    for s in rows:
        if s.stream == subjects.CONTROL and s.subject.startswith("fd.ctl.job."):
            seen.setdefault(s.subject.split(".")[3], None)
    return list(seen)


def _job_of(recorded: fdh.Recorded, wanted: str | None, name: str) -> str:
    """The job a file holds: `wanted` (checked), else its header's, else the only job in it (or the only one
    with telemetry: an export holds every job's control events but only its own job's telemetry)."""
    jobs = jobs_in(recorded.rows)
    if wanted:
        if wanted not in jobs:
            raise HistoryNotFound(f"{name} holds no history of job {wanted!r} (it has: {', '.join(jobs) or 'none'})")
        return wanted
    if recorded.header is not None and recorded.header.job_id:
        if recorded.header.job_id not in jobs:
            raise BadHistory(f"{name}: its header names job {recorded.header.job_id!r} but it holds no event of it")
        return recorded.header.job_id
    measured = {subjects.job_of(s.subject) for s in recorded.rows if s.stream == subjects.TELEMETRY}
    candidates = jobs if len(jobs) == 1 else [j for j in jobs if j in measured]
    if len(candidates) != 1:
        raise BadHistory(f"{name} holds the histories of {len(jobs)} jobs ({', '.join(jobs) or 'none'}): "
                         "name the one you mean")
    return candidates[0]


def _read(path: Path | str) -> fdh.Recorded:
    try:
        return fdh.read(path)
    except fdh.BadHistoryFile as exc:
        raise BadHistory(str(exc)) from None


def file_history(path: Path | str, job_id: str | None = None) -> History:
    recorded = _read(path)
    job = _job_of(recorded, job_id, str(path))
    header = recorded.header
    origin = f" (exported from {header.source})" if header is not None and header.source else ""
    records = [r.event for r in recorded.rows if isinstance(r.event, HistoryArchived) and r.event.job_id == job]
    return History(job_id=job, rows=recorded.rows, source=f"file {path}{origin}", header=header,
                   gaps=tuple(recorded_gaps(records)))


def import_file(path: Path | str, data_dir: Path | str | None = None,
                job_id: str | None = None) -> tuple[History, Path]:
    """Check the file whole, then keep it in the library (with a header) as `<data-dir>/histories/<job>.fdh`.
    A bad file raises BadHistory and stores nothing."""
    history = file_history(path, job_id)
    target = library_path(data_dir, history.job_id)
    header = history.header
    fdh.write(target, fdh.dump(history.rows, job_id=history.job_id, source=header.source if header else str(path),
                               exported_at=header.exported_at if header else None))
    return history, target


async def control_stream_id(url: str) -> str:
    """Which FD_CONTROL the broker at `url` holds: its creation time ("" if it does not say). A verify's mark
    (services/tools/audit/resume.py) is of one stream: another broker may hold the same job id."""
    async with open_store(url) as store:
        info = await store.js.stream_info(subjects.CONTROL)
    return info.created.isoformat() if info.created is not None else ""


async def from_broker(url: str, job_id: str, *, output: bool = False, objects_url: str | None = None,
                      since: tuple[int, int] = (1, 1)) -> History:
    """The job's history from the broker, with what the archiver stored of it from the object store at
    `objects_url` (default: $FLIGHTDECK_OBJECTS, else the data dir's, as the services find it); from the FD_CONTROL
    and FD_TELEMETRY positions `since` (read.job_history)."""
    where = objects_url or default_objects_url()
    async with open_store(url) as store, contextlib.AsyncExitStack() as stack:
        objects: ObjectStore | None = None
        unreadable = ""
        try:
            objects = await stack.enter_async_context(open_objects(where))
        except Exception as exc:  # a history without archived segments needs none; with them, each is a gap
            unreadable = f"the object store {where} cannot be opened: {exc}"
        try:
            rows, gaps = await job_history(store, job_id, output=output, objects=objects, unreadable=unreadable,
                                           since=since)
        except JobNotFound:
            raise HistoryNotFound(f"no job {job_id!r} on {url} and no imported history of it: check the id "
                                  "(`flightdeck events --all` lists every job's events)") from None
    return History(job_id=job_id, rows=rows, source=f"broker {url}", gaps=tuple(gaps))


async def open_history(job: str | None = None, *, from_file: Path | str | None = None,
                       data_dir: Path | str | None = None, nats: str | None = None, output: bool = False) -> History:
    """The history every verb reads. With `from_file`: that file (`job` picks one of its jobs if it holds
    several). Else `job` from the library in `data_dir` (see data_dir_of) if imported there, else from the
    broker at `nats` (see flightdeck.services.shell.broker.nats_url). Errors are UserErrors (one line, an exit code);
    StoreUnavailable passes through."""
    if job:
        try:
            subjects.token(job)
        except InvalidSubjectToken as exc:
            raise HistoryNotFound(str(exc)) from None
    if from_file is not None:
        return file_history(from_file, job)
    if not job:
        raise HistoryNotFound("name a job (JOB) or a history file (--from FILE)")
    kept = library_path(data_dir, job)
    if kept.exists():
        history = file_history(kept, job)
        return History(job_id=history.job_id, rows=history.rows, header=history.header, gaps=history.gaps,
                       source=f"imported history {kept}" + (f" (exported from {history.header.source})"
                                                            if history.header and history.header.source else ""))
    return await from_broker(nats_url(nats), job, output=output)

