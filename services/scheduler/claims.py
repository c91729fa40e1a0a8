"""A node's claim that the checkpoint a restart was to restore is bad, and the restart's wait for a second witness.

One node's failed read is evidence about that node as much as about the checkpoint: a node with a missing mount or
broken credentials "finds" every checkpoint bad, and trusting it once cost a job every good checkpoint it had
(issue 51). So a claim (CheckpointRejected) changes no catalog here: the restart it causes is free and waits for
the checkpoint service's own read of the store (CheckpointScrubbed naming the claiming node). Read back bad, the
checkpoint leaves the catalog and the restart falls back past it (or the job fails, none being left); read back
intact, it stays the restore point, and the resource manager cordons the node that could not read it, so the
restart goes elsewhere. Settings.claims "trust" keeps the older rule for histories recorded before.
"""

from flightdeck.events.checkpoint import CheckpointDeleted, CheckpointRejected, CheckpointScrubbed
from flightdeck.events.job import JobFailed
from flightdeck.services.scheduler import commit_wait
from flightdeck.services.scheduler.commit_wait import READ
from flightdeck.services.scheduler.state import Job
from flightdeck.services.scheduler.tx import Tx

READ_WAIT_S = 300.0  # the longest a restart waits for that read (the service reads at scrub_mb_s, one at a time)


def verifying(tx: Tx) -> bool:
    return tx.settings.claims == "verify"


def rejected(tx: Tx, ev: CheckpointRejected) -> None:
    """The current attempt's restore was refused by `ev.node`: its restart is free; the catalog keeps the checkpoint
    until the service's read says otherwise."""
    job = tx.jobs.get(ev.job_id)
    if job is None or ev.attempt != job.attempt or job.run.bad_restore:
        return
    tx.update(job, faults=(*job.faults, ev.event_id), claimed=ev.checkpoint_id,
              bad_restore=f"node {ev.node} could not restore checkpoint {ev.checkpoint_id} (step {ev.step}): "
                          f"{ev.cause[:300]}")


def hold_for_read(tx: Tx, job: Job, checkpoint_id: str) -> Job:
    """Keep the restart of `job` (its new attempt set) queued until the service has read `checkpoint_id` back."""
    if not any(c.checkpoint_id == checkpoint_id for c in job.checkpoints):
        return job  # deleted meanwhile: nothing to wait for
    return commit_wait.wait(tx, job, READ + checkpoint_id, READ_WAIT_S,
                            f"restart waits up to {READ_WAIT_S:g}s for the checkpoint service to read checkpoint "
                            f"{checkpoint_id} back from the store: one node's failed read does not make it bad")


def read_back(tx: Tx, ev: CheckpointScrubbed) -> None:
    """The service read a checkpoint back. Found bad, it leaves the catalog (any read's finding: the deletion that
    follows would take it out anyway); a restart waiting for this read goes ahead, or fails the job when the bad
    one was the last."""
    job = tx.jobs.get(ev.job_id)
    if job is None:
        return
    cid = ev.checkpoint_id
    if ev.cause:
        job = tx.update(job, checkpoints=tuple(c for c in job.checkpoints if c.checkpoint_id != cid))
    if job.waits_for != READ + cid:
        return
    who = f"node {ev.claim_node}" if ev.claim_node else "a node"
    if not ev.cause:
        why = (f"checkpoint {cid} read back intact by the checkpoint service: {who} could not read it, so the node "
               "is the suspect (cordoned); restoring it elsewhere")
        tx.update(job, waits_for="", wait_until=0.0, ask_reason=why)
        return
    bad = f"checkpoint {cid} (step {ev.step}) is bad: {who} could not restore it and the checkpoint service's read " \
          f"of the store found it bad too ({ev.cause[:300]})"
    if job.newest is None:
        _fail(tx, job, f"{bad}; no good checkpoint is left to restore")
        return
    good = job.newest
    tx.update(job, waits_for="", wait_until=0.0,
              ask_reason=f"{bad}; restoring {good.checkpoint_id} (step {good.step}), the newest good checkpoint")


def _fail(tx: Tx, job: Job, why: str) -> None:
    """End the waiting job as failed: its slots were released when its restart was decided."""
    tx.emit(JobFailed(job_id=job.job_id, reason=why, causes=list(job.faults)))
    tx.end(job, "failed", why)


def deleted(tx: Tx, ev: CheckpointDeleted) -> None:
    """A restart waiting for the read of a checkpoint deleted meanwhile waits no more."""
    job = tx.jobs.get(ev.job_id)
    if job is not None and job.waits_for == READ + ev.checkpoint_id:
        tx.update(job, waits_for="", wait_until=0.0,
                  ask_reason=f"checkpoint {ev.checkpoint_id} was deleted ({ev.reason}) while the restart waited for "
                             "its read: restoring the newest committed")


def deadlines(tx: Tx) -> None:
    """A read that did not come in time (the service down, or its store unreadable too): the checkpoint is set aside
    for this job's restarts, never deleted (the service still holds it), so that one blind node cannot hold the job
    for ever; the restart goes ahead from the newest other one. With none, the job fails saying so, rather than
    train again from scratch on the word of one node: the checkpoint stays in the store to adopt."""
    for job in list(tx.jobs.values()):
        if not job.waits_for.startswith(READ) or tx.at < job.wait_until:
            continue
        cid = job.waits_for.removeprefix(READ)
        job = tx.update(job, checkpoints=tuple(c for c in job.checkpoints if c.checkpoint_id != cid))
        unread = f"the checkpoint service did not read checkpoint {cid} back within {READ_WAIT_S:g}s"
        newest = job.newest
        if newest is None:
            _fail(tx, job, f"{unread}, and no other checkpoint is left to restore: it stays in the store, not deleted")
            continue
        tx.update(job, waits_for="", wait_until=0.0,
                  ask_reason=f"{unread}: it is set aside, not deleted, and the restart restores {newest.checkpoint_id} "
                             f"(step {newest.step})")
