"""What a job's history holds, read from a live store: everything needed to explain and re-check the job.

The scheduler's and resources' decisions about one job rest on the whole fleet (other jobs, nodes, their
own clock ticks), and FD_CONTROL is small next to telemetry, so a job's history keeps every control
message up to the job's last event; of telemetry only the job's own (`fd.tel.<job>.>`); and the dead
letters (a replay skips the inputs the server gave up on). Telemetry and output age out of their streams: what
the archiver stored of them is read first, then what the streams still hold (history/archived.py).
"""

from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.job import JobSubmitted
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.shell.objects.store import ObjectStore
from flightdeck.services.tools.history.archived import Gap, stream_rows


class JobNotFound(LookupError):
    """No control event of the job is stored."""


async def job_history(store: EventStore, job_id: str, *, output: bool = False,
                      objects: ObjectStore | None = None, unreadable: str = "no object store to read it from",
                      since: tuple[int, int] = (1, 1)) -> tuple[list[Stored], list[Gap]]:
    """The job's history: FD_CONTROL up to the job's last event, its telemetry (archived segments from `objects`,
    then the stream), FD_DEAD, and with `output` the lines its ranks printed (FD_LOGS: an export is whole); each
    stream in order. And the ranges where its telemetry or output may be missing. Raises JobNotFound when the
    job has no events. `since`: the FD_CONTROL and FD_TELEMETRY positions to read from (a verify going on from an
    earlier one's mark: services/tools/audit/resume.py)."""
    last = await store.last(subjects.CONTROL, subjects.job_all(job_id))
    if last is None:
        raise JobNotFound(job_id)
    rows: list[Stored] = []
    async for batch in store.read(subjects.CONTROL, from_seq=since[0], until_seq=last.seq):
        rows += batch
    prefix = f"fd.ctl.job.{job_id}."
    own = [r.event for r in rows if r.subject.startswith(prefix)]
    if since[0] > 1:  # the records of what was archived before, and the submission, from the job's whole history
        wanted = [subjects.job(job_id, "HistoryArchived"), subjects.job(job_id, "JobSubmitted")]
        own = [r.event async for batch in store.read(subjects.CONTROL, wanted, until_seq=since[0] - 1)
               for r in batch] + own
    records = [e for e in own if isinstance(e, HistoryArchived)]
    submitted_at = next((e.occurred_at for e in own if isinstance(e, JobSubmitted)), 0.0)
    mine = {stream: [r for r in records if r.stream == stream] for stream in (subjects.TELEMETRY, subjects.LOGS)}
    telemetry, gaps = await stream_rows(store, objects, job_id, subjects.TELEMETRY, mine[subjects.TELEMETRY],
                                        submitted_at, unreadable=unreadable, from_seq=since[1])
    rows += telemetry
    async for batch in store.read(subjects.DEAD):
        rows += batch
    if output:
        lines, lost = await stream_rows(store, objects, job_id, subjects.LOGS, mine[subjects.LOGS], submitted_at,
                                        unreadable=unreadable)
        rows += lines
        gaps += lost
    return rows, gaps


async def job_rows(store: EventStore, job_id: str, *, output: bool = False,
                   objects: ObjectStore | None = None) -> list[Stored]:
    """`job_history`'s rows."""
    return (await job_history(store, job_id, output=output, objects=objects))[0]
