"""How one job moves through its phases, input by input.

Why it works this way: docs/internals.md, "3. The scheduler and its recovery recipes" (lifecycle choreography).
"""

from collections.abc import Iterable

from flightdeck.events.checkpoint import CheckpointDeleted, CheckpointRejected
from flightdeck.events.commands import PauseRequested, ResumeRequested, StopRequested
from flightdeck.events.findings import RankHung, RankLost, StragglerDetected
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobQueued,
    JobResumed,
    JobSubmitted,
    WorkersExited,
    WorkersStarted,
    failed,
)
from flightdeck.services.scheduler import claims, commit_wait
from flightdeck.services.scheduler.policy import (
    NEVER_HEARD,
    Fail,
    Restart,
    after_bad_checkpoint,
    after_fault,
    early_way,
    fault_reason,
    no_retry,
    same_again,
)
from flightdeck.services.scheduler.state import Attempt, Job
from flightdeck.services.scheduler.tx import Tx


def submitted(tx: Tx, ev: JobSubmitted) -> None:
    if ev.job_id in tx.jobs or ev.job_id in tx.ended:  # the same submission seen again
        return
    job = tx.put(Job(job_id=ev.job_id, spec=ev.spec, order=tx.next_order))
    tx.next_order += 1
    tx.enqueue(job)
    tx.emit(JobQueued(job_id=job.job_id, priority=job.spec.priority, reason="submitted"))


def _current(tx: Tx, job_id: str, attempt: int) -> Job | None:
    job = tx.jobs.get(job_id)
    return job if job is not None and job.attempt == attempt else None


def granted(tx: Tx, ev: AllocationGranted) -> None:
    job = _current(tx, ev.job_id, ev.attempt)
    if job is None:
        # Slots granted to an attempt nobody waits for would stay booked: give them back.
        tx.emit(AllocationReleased(job_id=ev.job_id, attempt=ev.attempt, reason="stale grant", kind="stale"))
        return
    if not job.run.requested:
        return  # the same grant read again
    refs = tuple(sorted(ev.assignments, key=lambda r: r.rank))
    restore = job.run.restore if tx.settings.restores == "requested" else job.newest  # as the request said, or now
    skips = job.skips_of(restore)
    job = tx.update(job, requested=False, assignments=refs, restore=restore, use_spares=False, skips=skips,
                    world=0 if len(refs) == job.spec.slots else len(refs))
    if job.run.stop == "cancel":
        cancel_now(tx, job)


def denied(tx: Tx, ev: AllocationDenied) -> None:
    job = _current(tx, ev.job_id, ev.attempt)
    if job is None or not job.run.requested:
        return
    job = tx.update(job, requested=False, denied_epoch=job.run.asked_epoch, denied_world=job.size,
                    phase="queued" if job.phase == "placing" else job.phase, why=f"allocation denied: {ev.reason}")
    if job.run.stop == "cancel":
        cancel_now(tx, job)
        return
    tx.enqueue(job)
    tx.emit(JobQueued(job_id=job.job_id, priority=job.spec.priority, reason=f"allocation denied: {ev.reason}"))


def started(tx: Tx, ev: WorkersStarted) -> None:
    job = _current(tx, ev.job_id, ev.attempt)
    if job is None or not job.run.assignments:
        return
    job = tx.update(job, started=job.run.started | (frozenset(ev.ranks) & job.ranks))
    if job.run.stop or job.phase not in ("placing", "recovering") or not job.ranks <= job.run.started:
        return
    job = tx.update(job, phase="running", why="", running_since=tx.at)
    if job.attempt > 0 or job.run.restore is not None:
        tx.emit(JobResumed(job_id=job.job_id, attempt=job.attempt, world_size=len(job.run.assignments),
                           from_step=job.run.restore.step if job.run.restore else 0,
                           checkpoint_id=job.run.restore.checkpoint_id if job.run.restore else ""))


def pause(tx: Tx, ev: PauseRequested | ResumeRequested) -> None:
    """A pause (a person's, or the scheduler's own asking the operator) or a resume, read from the stream: the
    running attempt's ranks stop stepping until resumed, which the job's recorded phase says ("paused"). A new
    attempt's ranks start unpaused (a new Attempt)."""
    job = tx.jobs.get(ev.job_id)
    if job is None:
        return
    if isinstance(ev, PauseRequested):
        if job.phase == "running" and not job.run.paused:
            tx.update(job, paused=ev.reason or f"paused by {ev.producer or 'a person'}")
    elif job.run.paused:
        tx.update(job, paused="")


def exited(tx: Tx, ev: WorkersExited) -> None:
    """Ranks of one node ended (one record per node: the first failed rank heads it, and decides)."""
    job = _current(tx, ev.job_id, ev.attempt)
    if job is None:
        return
    exits = [x for x in ev.exits() if x.rank in job.ranks and x.rank not in job.run.exited]
    if not exits:
        return
    ranks = {x.rank for x in exits}
    bad = next((x for x in exits if failed(x)), None)
    if job.run.stop:
        ranks_gone(tx, job, ranks)
    elif bad is not None and bad.unrunnable:  # the same command fails the same way on any slot: no restart
        job = tx.update(job, exited=job.run.exited | ranks, faults=(*job.faults, ev.event_id))
        fail(tx, job, f"{fault_reason(ev)}; not restarted: the job's command cannot run", job.faults)
    elif bad is not None and (why := no_retry(job, bad)):
        job = tx.update(job, exited=job.run.exited | ranks, faults=(*job.faults, ev.event_id))
        fail(tx, job, f"{fault_reason(ev)}; {why}", job.faults)
    elif bad is not None:
        planned = all(x.planned for x in exits if failed(x))
        # ranks that died with their agent (killed with it, recorded by the next agent there): the agent's fault
        orphans = tx.settings.agent_faults == "free" and all(x.orphaned for x in exits if failed(x))
        reason = fault_reason(ev) + ("; they died with their node agent" if orphans and not planned else "")
        fault(tx, job, ev.event_id, reason, ranks, planned=planned, early=early_way(bad),
              staged=any(x.persisted == "staged" for x in exits), blameless=orphans and not planned)
    else:
        job = tx.update(job, exited=job.run.exited | ranks)
        if job.ranks <= job.run.exited:  # every rank finished with 0, and nobody asked it to stop
            tx.emit(JobCompleted(job_id=job.job_id, steps=job.spec.train.steps))
            tx.release(job, "completed", "ended")
            tx.end(job, "completed", "")


def finding(tx: Tx, ev: RankLost | RankHung | StragglerDetected) -> None:
    job = _current(tx, ev.job_id, ev.attempt)
    if job is None or ev.rank not in job.ranks or ev.rank in job.run.exited:
        return
    if isinstance(ev, StragglerDetected):  # slow, not gone: replaced only if the policy says so
        if job.spec.policy.replace_stragglers and not job.run.stop:
            fault(tx, job, ev.event_id, fault_reason(ev), {ev.rank})
        return
    if job.run.stop:  # a rank that cannot finish its stop counts as gone; releasing the slots kills it
        ranks_gone(tx, job, {ev.rank})
    else:
        # A hung rank trained nothing for stalled_s, a silent one nothing since it was last heard of: what a wait
        # for its snapshots could save ends there, not at the finding.
        until = (ev.occurred_at or tx.at) - ev.stalled_s if isinstance(ev, RankHung) else ev.last_seen
        way = NEVER_HEARD if isinstance(ev, RankLost) and ev.never_heard else ""
        if why := same_again(job, way):
            job = tx.update(job, exited=job.run.exited | {ev.rank}, faults=(*job.faults, ev.event_id))
            fail(tx, job, f"{fault_reason(ev)}; {why}", job.faults)
            return
        fault(tx, job, ev.event_id, fault_reason(ev), {ev.rank}, trained_until=until, early=way)


def node_lost(tx: Tx, node: str, reason: str, cause_id: str) -> None:
    tx.set_node(node, lost=True, cordoned=True)
    commit_wait.node_lost(tx, node)
    for job in tx.live():
        gone = {r.rank for r in job.run.assignments if r.node == node} - job.run.exited
        if not gone:
            continue
        if job.run.stop:
            ranks_gone(tx, job, gone)
        elif tx.settings.agent_faults == "free" and not gone & job.run.started:
            # its agent never started them (it died idle, or froze): the job ran nothing there to cause the loss
            fault(tx, job, cause_id, f"node {node} lost before it started ranks {sorted(gone)}: {reason}", gone,
                  lost_node=node, blameless=True)
        else:
            fault(tx, job, cause_id, f"node {node} lost: {reason}", gone, lost_node=node)


def fault(tx: Tx, job: Job, cause_id: str, reason: str, gone: Iterable[int], *, lost_node: str = "",
          planned: bool = False, trained_until: float = 0.0, early: str = "", staged: bool = False,
          blameless: bool = False) -> None:
    """Restart the job on fresh slots, or fail it once the restart budget is spent. Surviving ranks are
    told to stop first (no checkpoint: the newest committed one is the restore point, or the one on its way
    when waiting for it loses less: commit_wait.py); releasing the allocation makes the node agents kill
    whatever does not stop. `planned`: the platform stopped the ranks itself (an agent shutting down), which
    costs the job no restart, and its ranks saved a checkpoint on the way out that the restart waits for.
    `trained_until`: when the job last made progress, if before now (a hung rank). `early`: how the attempt
    failed before its first step ("" if it did not), for the next attempt's failure to be compared with.
    `staged`: the exits that brought the fault said a rank's snapshot was staged for the store. `blameless`: the
    attempt ran nothing that could have caused it (a node lost before it started the ranks granted to it, ranks
    that died with their agent), so the restart costs the budget nothing."""
    job = tx.update(job, exited=job.run.exited | frozenset(gone), faults=(*job.faults, cause_id), early_failure=early)
    free = bool(job.run.bad_restore) or planned or blameless
    if planned:
        recovery: Restart | Fail = Restart(f"{reason}; the node agent stopped them as it shut down: restarting, "
                                           "not counted against the restart budget")
    elif blameless:
        recovery = Restart(f"{reason}; restarting, not counted against the restart budget")
    else:
        recovery = after_bad_checkpoint(job, reason) if job.run.bad_restore else after_fault(job, reason)
    unsettled = job.run.started - job.run.exited  # ranks whose end is not recorded: their node may be lost
    where = tuple(r for r in job.run.assignments if r.rank in unsettled)
    if unsettled:
        tx.emit(StopRequested(job_id=job.job_id, checkpoint=False, reason=recovery.reason))
    match recovery:
        case Restart(reason=why):
            pending, since, claimed = job.run.pending, job.run.running_since, job.run.claimed
            job = tx.update(job, restarts=job.restarts + (0 if free else 1))
            job = tx.release(job, why, "fault")
            job = tx.update(job, phase="recovering", why=why, run=Attempt(number=job.attempt + 1, use_spares=True))
            if claimed:  # one node's word against the restore point: the service reads it back first
                job = claims.hold_for_read(tx, job, claimed)
            if planned:
                job = commit_wait.hold_for_save(tx, job)
            if not job.waits_for:  # a fully staged set first: it is on its way already
                job = commit_wait.hold(tx, job, pending, since, lost_node)
            if not job.waits_for and not (job.run.bad_restore or planned):  # a lost node's ranks leave none: the
                # survivors' may do (DDP); an agent that died with its ranks persists theirs when it comes back
                job = commit_wait.hold_for_memory(tx, job, since, trained_until, unsettled=unsettled, where=where,
                                                  staged=staged)
            tx.enqueue(job)
        case Fail(reason=why):
            fail(tx, job, why, job.faults, stopped=True)


def fail(tx: Tx, job: Job, reason: str, causes: Iterable[str], *, stopped: bool = False) -> None:
    """End the job as failed; ranks still running are told to stop first (unless `stopped` says they were)."""
    if not stopped and job.run.started - job.run.exited:
        tx.emit(StopRequested(job_id=job.job_id, checkpoint=False, reason=reason))
    tx.emit(JobFailed(job_id=job.job_id, reason=reason, causes=list(causes)))
    tx.release(job, "failed", "ended")
    tx.end(job, "failed", reason)


def cancel(tx: Tx, ev: CancelRequested) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or job.run.stop == "cancel":
        return
    reason = ev.reason or "cancel requested"
    if job.run.requested:  # the allocation's answer is on its way: cancel once it arrives
        tx.update(job, stop="cancel", stop_reason=reason, stop_since=tx.at)
    elif job.phase == "running" or job.run.stop:  # a stop already in flight (a preemption's) will do
        if not job.run.stop:
            tx.emit(StopRequested(job_id=job.job_id, checkpoint=False, reason=f"cancelled: {reason}"))
        tx.update(job, phase="stopping", why=reason, stop="cancel", stop_reason=reason,
                  stop_since=job.run.stop_since if job.run.stop else tx.at)
    else:  # waiting in the queue (holds nothing), or ranks still starting (releasing kills them)
        cancel_now(tx, tx.update(job, stop="cancel", stop_reason=reason))


def cancel_now(tx: Tx, job: Job) -> None:
    tx.emit(JobCancelled(job_id=job.job_id, reason=job.run.stop_reason))
    if job.run.assignments or job.run.requested:
        tx.release(job, "cancelled", "ended")
    tx.end(job, "cancelled", job.run.stop_reason)


def ranks_gone(tx: Tx, job: Job, ranks: Iterable[int]) -> None:
    """Ranks of a stopping job are gone; once all are, the stop is done."""
    job = tx.update(job, exited=job.run.exited | frozenset(ranks))
    if job.ranks <= job.run.exited:
        finish_stop(tx, job, "")


def finish_stop(tx: Tx, job: Job, note: str) -> None:
    if job.run.stop == "cancel":
        cancel_now(tx, job)
        return
    grow = job.run.stop == "grow"
    job = tx.release(job, job.run.stop_reason + note, "grow" if grow else "preempt")
    job = tx.update(job, phase="recovering" if grow else "preempted", why=job.run.stop_reason + note,
                    run=Attempt(number=job.attempt + 1, ask_reason="grow back" if grow else ""))
    tx.enqueue(job)
    tx.emit(JobQueued(job_id=job.job_id, priority=job.spec.priority, reason="grow back" if grow else "preempted"))


def stop_deadlines(tx: Tx, timeout_s: float) -> None:
    """Stops that outlast `timeout_s` end anyway: releasing the slots makes the agents kill the ranks."""
    for job in list(tx.jobs.values()):
        if job.run.stop and job.run.assignments and tx.at - job.run.stop_since >= timeout_s:
            finish_stop(tx, job, f"; stop timed out after {timeout_s:g}s")


def checkpoint_rejected(tx: Tx, ev: CheckpointRejected) -> None:
    """A checkpoint found bad on restore leaves the catalog (restarts fall back past it); if it was this
    attempt's, the exits that follow restart the job for free."""
    job = tx.jobs.get(ev.job_id)
    if job is None:
        return
    job = tx.update(job, checkpoints=tuple(c for c in job.checkpoints if c.checkpoint_id != ev.checkpoint_id))
    if ev.attempt == job.attempt and not job.run.bad_restore:
        tx.update(job, faults=(*job.faults, ev.event_id),
                  bad_restore=f"checkpoint {ev.checkpoint_id} (step {ev.step}) is bad: {ev.cause[:300]}")


def checkpoint_deleted(tx: Tx, ev: CheckpointDeleted) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is not None:
        tx.update(job, checkpoints=tuple(c for c in job.checkpoints if c.checkpoint_id != ev.checkpoint_id),
                  abandoned=job.abandoned - {ev.checkpoint_id})
