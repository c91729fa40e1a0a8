"""A store that refuses a job's checkpoints, and a completed job whose final state is not stored: findings of the
checkpoint service, never silent. On 6ade4e9 a full store failed 34 uploads in a row, each with a clear line in a
log, and nothing else said so; a rank crash then restored step 50 and the job ended "completed 600/600" with its
newest checkpoint at step 50 (issue 51). Pure functions of the service's state (Settings.failing_after > 0).

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

from msgspec.structs import replace

from flightdeck.events.base import JobEvent
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointsFailing,
    CheckpointsRecovered,
    FinalStateSaved,
    FinalStateUnsaved,
)
from flightdeck.events.job import JobCompleted
from flightdeck.services.checkpoints.state import JobState

Found = tuple[JobState, tuple[JobEvent, ...]]


def newest_step(job: JobState) -> int:
    """The newest committed checkpoint that is not being deleted nor found bad (-1: none)."""
    return max((c.step for c in job.committed if c.checkpoint_id not in job.doomed and c.checkpoint_id not in job.bad),
               default=-1)


def final_open(job: JobState) -> bool:
    """A set of the completed job's last step may still commit: staged but not handed over yet, or being committed."""
    return job.final >= 0 or any(step == job.last_step for step in job.committing.values())


def failed(job: JobState, ev: CheckpointFailed, after: int) -> Found:
    """A set failed (the service's own CheckpointFailed, read back). The store's part counts: `after` in a row is
    an incident, said once until a commit; a completed job whose last set of its last step failed, with no other
    on its way, has its final state unsaved."""
    found: list[JobEvent] = []
    job = replace(job, last_failed=ev.step, committing={k: v for k, v in job.committing.items()
                                                        if k != ev.checkpoint_id})
    if ev.store:
        job = replace(job, failures=job.failures + 1, failing_from=ev.step if job.failures == 0 else job.failing_from)
        if job.failures >= after and not job.failing:
            job = replace(job, failing=True)
            found.append(CheckpointsFailing(job_id=ev.job_id, failures=job.failures, first_step=job.failing_from,
                                            step=ev.step, newest_step=newest_step(job), reason=ev.reason))
    if job.completed and ev.step == job.last_step and not job.final_state and not final_open(job):
        job, unsaved = _unsaved(job, ev.job_id, f"its final checkpoint failed: {ev.reason}")
        found.append(unsaved)
    return job, tuple(found)


def committed(job: JobState, ev: CheckpointCommitted, *, amend: bool = False) -> Found:
    """A set committed (read back): the store takes the job's checkpoints; the final one saves its final state, and
    with `amend` (Settings.final_late) one that comes after its final state was said unsaved says that is over."""
    found: list[JobEvent] = []
    if job.failing:
        found.append(CheckpointsRecovered(job_id=ev.job_id, step=ev.step, failures=job.failures))
    job = replace(job, failures=0, failing_from=-1, failing=False,
                  committing={k: v for k, v in job.committing.items() if k != ev.checkpoint_id})
    if job.completed and ev.step == job.last_step and not job.final_state:
        job = replace(job, final_state="saved")
    elif job.completed and ev.step == job.last_step and job.final_state == "unsaved" and amend:
        job = replace(job, final_state="saved")
        found.append(FinalStateSaved(job_id=ev.job_id, step=ev.step, checkpoint_id=ev.checkpoint_id))
    return job, tuple(found)


def completed(job: JobState, ev: JobCompleted) -> Found:
    """The job completed: its final state is saved already, or on its way (a set of its last step staged or being
    committed), or unsaved: that set failed, or, with none due by its spec, its checkpoints were failing."""
    job = replace(job, last_step=ev.steps)
    if any(c.step == ev.steps for c in job.committed):
        return replace(job, final_state="saved"), ()
    if final_open(job):
        return job, ()
    if job.last_failed == ev.steps:  # its final set failed before the completion was read
        job, unsaved = _unsaved(job, ev.job_id, "its final checkpoint failed")
        return job, (unsaved,)
    if not job.failing:
        return job, ()
    job, unsaved = _unsaved(job, ev.job_id, f"its checkpoints were failing when it completed ({job.failures} in a "
                                            f"row since step {job.failing_from})")
    return job, (unsaved,)


def lingered(job: JobState, job_id: str, now: float, linger_s: float) -> Found:
    """A completed job's final set never came to be handed over within `linger_s` of its completion."""
    if not job.completed or job.final < 0 or job.final_state or now - job.ended_at < linger_s:
        return job, ()
    job = replace(job, final=-1)
    if final_open(job):  # a set of that step is being committed: its outcome says
        return job, ()
    job, unsaved = _unsaved(job, job_id, f"its final checkpoint (step {job.last_step}) was not staged by every rank "
                                         f"within {linger_s:g}s of its completion")
    return job, (unsaved,)


def _unsaved(job: JobState, job_id: str, why: str) -> tuple[JobState, FinalStateUnsaved]:
    newest = newest_step(job)
    where = f"the newest saved state is step {newest}" if newest >= 0 else "no state of it is saved"
    return replace(job, final_state="unsaved"), FinalStateUnsaved(job_id=job_id, step=job.last_step,
                                                                  newest_step=newest, reason=f"{why}; {where}")
