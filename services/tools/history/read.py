"""What a job's history holds, read from a live store: everything needed to explain and re-check the job.

The scheduler's and resources' decisions about one job rest on the whole fleet (other jobs, nodes, their
own clock ticks), and FD_CONTROL is small next to telemetry, so a job's history keeps every control
message up to the job's last event; of telemetry only the job's own (`fd.tel.<job>.>`); and the dead
letters (a replay skips the inputs the server gave up on).
"""

from events import subjects
from events.store import EventStore, Stored


class JobNotFound(LookupError):
    """No control event of the job is stored."""


async def job_rows(store: EventStore, job_id: str, *, output: bool = False) -> list[Stored]:
    """The job's history: FD_CONTROL up to the job's last event, its telemetry, FD_DEAD, and with `output` the
    lines its ranks printed (FD_LOGS: an export is whole); each stream in order, read in batches (the JetStream
    store's fast reader). Raises JobNotFound when the job has no events."""
    last = await store.last(subjects.CONTROL, subjects.job_all(job_id))
    if last is None:
        raise JobNotFound(job_id)
    rows: list[Stored] = []
    async for batch in store.read(subjects.CONTROL, until_seq=last.seq):
        rows += batch
    async for batch in store.read(subjects.TELEMETRY, [subjects.telemetry_job(job_id)]):
        rows += batch
    async for batch in store.read(subjects.DEAD):
        rows += batch
    if output:
        async for batch in store.read(subjects.LOGS, [subjects.logs_filter(job_id)]):
            rows += batch
    return rows
