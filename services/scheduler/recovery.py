"""Carrying out the recipes of recipes.py on one transition: rollbacks, their landing, and growing back.

Why it works this way: docs/internals.md, "3. The scheduler and its recovery recipes".
"""

import msgspec

from flightdeck.events import lineage
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointRefused
from flightdeck.events.commands import PauseRequested, RollbackRequested, StopRequested
from flightdeck.events.job import RollbackAsked
from flightdeck.events.training import RolledBack
from flightdeck.services.scheduler import commit_wait, queue, recipes
from flightdeck.services.scheduler.lifecycle import fail
from flightdeck.services.scheduler.policy import Fail
from flightdeck.services.scheduler.state import Checkpoint, Job, Rollback
from flightdeck.services.scheduler.tx import Tx


def in_flight(job: Job, now: float, landing_timeout_s: float) -> bool:
    rb = job.run.rollback
    return rb is not None and rb.attempt == job.attempt and not rb.landed and now - rb.at < landing_timeout_s


def loss_finding(tx: Tx, ev: recipes.LossFinding, landing_timeout_s: float) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or ev.attempt != job.attempt or job.phase != "running" or job.run.stop:
        return
    if in_flight(job, tx.at, landing_timeout_s):
        return
    if (job.incident is not None and ev.event_id in job.incident.triggers) or ev.event_id == job.asked_for:
        return  # the same finding read again
    match recipes.after_loss(job, ev):
        case recipes.RollTo() as plan:
            roll(tx, job, plan, ev.event_id)
        case recipes.Ask(reason=why):
            tx.emit(PauseRequested(job_id=job.job_id, reason=why))
            tx.update(job, asked_for=ev.event_id)
        case Fail(reason=why, causes=causes):
            fail(tx, job, why, causes)


def roll(tx: Tx, job: Job, plan: recipes.RollTo, trigger_id: str, *, asked: str = "") -> None:
    target = plan.checkpoint
    command = RollbackRequested(job_id=job.job_id, checkpoint_id=target.checkpoint_id, to_step=target.step,
                                skip_from=plan.skip_from, skip_to=plan.skip_to, reason=plan.reason,
                                trigger_id=trigger_id, attempt=job.attempt, replay=plan.replay)
    tx.emit(command)
    thrown = {c.checkpoint_id for c in job.checkpoints if c.step > target.step}
    window, skips = (plan.skip_from, plan.skip_to), job.run.skips
    skips = skips if window in skips else (*skips, window)
    tx.update(job, incident=plan.incident or job.incident, abandoned=job.abandoned | thrown,
              forks=lineage.forked(job.forks, command),
              skips=skips, rollback=Rollback(attempt=job.attempt, checkpoint_id=target.checkpoint_id,
                                             to_step=target.step, skip_from=plan.skip_from, skip_to=plan.skip_to,
                                             at=tx.at, asked=asked))


def asked(tx: Tx, ev: RollbackAsked, landing_timeout_s: float) -> None:
    """An operator's rollback of a running job: to its newest checkpoint at or before `to_step` that no rollback
    threw away, skipping the window asked for. Nothing is decided for a job that is not running, is stopping, has
    a rollback in flight, or has no such checkpoint (the client says so before it asks)."""
    job = tx.jobs.get(ev.job_id)
    if job is None or job.phase != "running" or job.run.stop or in_flight(job, tx.at, landing_timeout_s):
        return
    target = recipes.newest_at_or_before(job, ev.to_step)
    if target is None:
        return
    skip = (ev.skip_from, ev.skip_to) if ev.skip_to > ev.skip_from else (0, 0)
    reason = (f"asked by {ev.producer or 'an operator'}: roll back to {target.checkpoint_id} (step {target.step})"
              + (f" and skip batches [{skip[0]}, {skip[1]})" if skip != (0, 0) else "")
              + (f": {ev.reason}" if ev.reason else ""))
    roll(tx, job, recipes.RollTo(checkpoint=target, skip_from=skip[0], skip_to=skip[1], reason=reason, incident=None),
         ev.event_id, asked=ev.event_id)


def refused(tx: Tx, ev: CheckpointRefused) -> None:
    """A rank found the rollback's checkpoint bad and no rank loaded it: it leaves the catalog, and the rollback is
    decided again without it (recipes.reroll). A refusal of anything but the rollback in flight changes no plan."""
    job = tx.jobs.get(ev.job_id)
    if job is None:
        return
    job = tx.update(job, checkpoints=tuple(c for c in job.checkpoints if c.checkpoint_id != ev.checkpoint_id))
    rb = job.run.rollback
    if rb is None or rb.landed or (ev.attempt, ev.checkpoint_id) != (rb.attempt, rb.checkpoint_id) \
            or job.attempt != rb.attempt or job.phase != "running" or job.run.stop:
        return
    why = (f"checkpoint {ev.checkpoint_id} (step {ev.to_step}) is bad on {ev.node or 'its node'} (rank {ev.rank}): "
           f"{ev.cause[:300]}")
    if rb.asked:  # an operator's: the next older checkpoint, the same window; none left, and the ranks train on
        older = recipes.newest_at_or_before(job, rb.to_step)
        if older is not None:
            reason = f"{why}; the operator's rollback goes to {older.checkpoint_id} (step {older.step}) instead"
            roll(tx, job, recipes.RollTo(checkpoint=older, skip_from=rb.skip_from, skip_to=rb.skip_to, reason=reason,
                                         incident=None), rb.asked, asked=rb.asked)
        return
    match recipes.reroll(job, why):
        case recipes.RollTo() as plan:
            roll(tx, job, plan, job.incident.triggers[-1] if job.incident else "")
        case Fail(reason=why, causes=causes):
            fail(tx, job, why, (*causes, ev.event_id))


def rolled_back(tx: Tx, ev: RolledBack) -> None:
    job = tx.jobs.get(ev.job_id)
    rb = job.run.rollback if job is not None else None
    if job is None or rb is None or rb.landed or ev.attempt != rb.attempt or ev.checkpoint_id != rb.checkpoint_id:
        return
    if (ev.skip_from, ev.skip_to) == (rb.skip_from, rb.skip_to):
        tx.update(job, rollback=msgspec.structs.replace(rb, landed=True))


def checkpoint_committed(tx: Tx, ev: CheckpointCommitted, landing_timeout_s: float) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or any(c.checkpoint_id == ev.checkpoint_id for c in job.checkpoints):
        return
    entry = Checkpoint(checkpoint_id=ev.checkpoint_id, step=ev.step, at=ev.occurred_at or tx.at, data=ev.data,
                       attempt=ev.attempt, timeline=ev.timeline, rank_bytes=ev.rank_bytes,
                       staged_at=commit_wait.staged_at(job, ev.checkpoint_id), manifest_sha256=ev.manifest_sha256,
                       from_memory=ev.from_memory)
    job = tx.update(job, checkpoints=(*job.checkpoints, entry),
                    abandoned=job.abandoned | {ev.checkpoint_id} if thrown_away(job, ev) else job.abandoned)
    grow_at_commit(tx, job, ev, landing_timeout_s)


def thrown_away(job: Job, ev: CheckpointCommitted) -> bool:
    """Whether a commit arriving now holds steps a rollback of the current attempt threw away."""
    rb = job.run.rollback
    if rb is None or rb.attempt != job.attempt or ev.step <= rb.to_step:
        return False
    if rb.skip_to > rb.skip_from:
        return all(tuple(w) != (rb.skip_from, rb.skip_to) for w in ev.data.skipped)
    return not rb.landed


def grow_at_commit(tx: Tx, job: Job, ev: CheckpointCommitted, landing_timeout_s: float) -> None:
    """A shrunk running job grows back once the whole gang would fit again (recipes.py, "Grow back")."""
    full = job.spec.slots
    if job.size >= full or job.phase != "running" or job.run.stop or not job.ranks <= job.run.started:
        return
    newest = job.newest
    if newest is None or newest.checkpoint_id != ev.checkpoint_id or ev.checkpoint_id in job.abandoned:
        return  # the restart restores the newest commit (the node agent's rule): it must be this one
    if in_flight(job, tx.at, landing_timeout_s) or not queue.can_grow(tx, job):
        return
    reason = (f"grow back to {full} slots from {job.size}: the slots are free again; "
              f"restore {ev.checkpoint_id} (step {ev.step})")
    tx.emit(StopRequested(job_id=job.job_id, checkpoint=False, reason=reason))
    tx.update(job, phase="stopping", why=reason, stop="grow", stop_reason=reason, stop_since=tx.at)
