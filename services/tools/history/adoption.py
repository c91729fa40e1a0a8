"""A job that starts from another job's checkpoint (spec `init_from`; `flightdeck submit --resume-from JOB`): the
client resolves which checkpoint before the job is submitted, by the rule a restart of that job would follow (the
node agent's `newest`: the highest step no rollback threw away, not deleted, not found bad), so the recorded spec
names exactly one checkpoint, and every node of the new job restores that one.

Only an ended job's checkpoints are adopted: a running job's retention may still delete them.
"""

from collections.abc import Sequence

import msgspec

from flightdeck.events import lineage
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointRejected
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import JobSubmitted
from flightdeck.events.spec import InitFrom, JobSpec
from flightdeck.services.tools.cli import EXIT_ERROR, EXIT_NOT_FOUND, UserError
from flightdeck.services.tools.history.jobview import JobView


def resolved(init: InitFrom, view: JobView, history: Sequence[object]) -> InitFrom:
    """`init` with its checkpoint chosen from the adopted job's history (`view` is that job's status)."""
    if not view.ended:
        raise UserError(f"{init.job} is {view.phase}: a job starts only from an ended job's checkpoint (a running "
                        "one may still delete it); cancel it first, or roll it back instead", EXIT_ERROR)
    gone = {e.checkpoint_id for e in history if isinstance(e, CheckpointDeleted | CheckpointRejected)}
    forks: tuple[lineage.Fork, ...] = ()
    kept: list[CheckpointCommitted] = []
    for e in history:
        if isinstance(e, RollbackRequested):
            forks = lineage.forked(forks, e)
        elif isinstance(e, CheckpointCommitted) and e.checkpoint_id not in gone \
                and (init.step < 0 or e.step <= init.step):
            kept.append(e)
    chosen = lineage.newest(kept, forks)
    if chosen is None:
        at = f" at or before step {init.step}" if init.step >= 0 else ""
        raise UserError(f"{init.job} has no good committed checkpoint{at} to start from", EXIT_NOT_FOUND)
    return msgspec.structs.replace(init, checkpoint_id=chosen.checkpoint_id, checkpoint_step=chosen.step,
                                   manifest_sha256=chosen.manifest_sha256)


def continuing(job_id: str, history: Sequence[object]) -> JobSpec:
    """The spec of a new job that continues `job_id` (`submit --resume-from`): its own spec and code, from its
    newest good checkpoint, with everything it held (model, optimizer, data position, step). Its drill faults are
    not carried over: they were that job's drill."""
    submitted = next((e for e in history if isinstance(e, JobSubmitted)), None)
    if submitted is None:
        raise UserError(f"no job {job_id!r}: `flightdeck status` lists every job", EXIT_NOT_FOUND)
    return msgspec.structs.replace(submitted.spec, faults=[], init_from=InitFrom(job=job_id, what="all"))
