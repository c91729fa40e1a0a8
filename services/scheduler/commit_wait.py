"""A restart that waits for a commit already on its way, when that loses less work than restoring an older one.

Once every rank has staged a checkpoint (CheckpointPending) only its agents' uploads and the service's read-back
remain, which no longer need the ranks. A restart decided in that window would otherwise restore the previous
checkpoint and redo every step in between (in a recorded H100 drill: 50 steps, for a commit that landed 0.6 s
after the restart). So the restart stays queued until the commit lands, fails, or `policy.commit_wait_s` passes,
and never longer than the steps it would save took to train: waiting can cost at most what it may save.
"""

from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointPending
from flightdeck.events.job import JobQueued, SlotRef, WorkersExited
from flightdeck.services.scheduler.state import Job, Pending
from flightdeck.services.scheduler.tx import Tx

# Settings.memory_wait values that know when no set can come ("promised" also waits for one an exit said is staged)
KNOWN = ("known", "promised")
# Announced sets remembered until they settle; more than this many unsettled means commits have stopped.
MAX_STAGED = 8
# `waits_for` of a restart after the platform stopped the ranks itself: the checkpoint they saved on the way out,
# not announced yet when their exits come in (the checkpoint service folds the stagings at its next tick).
STOP_SAVE = "*"
# ... and after a fault: the set the failed attempt's agents persist from their ranks' snapshots in memory
# (services/agent/snapshots.py), staged as each rank's exit is seen.
MEMORY = "memory"
# ... and after a node's claim that the restore point is bad: the checkpoint service's read of it (claims.py)
READ = "read:"


def pending(tx: Tx, ev: CheckpointPending) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None or ev.attempt != job.attempt:
        return
    if all(cid != ev.checkpoint_id for cid, _ in job.staged):
        job = tx.update(job, staged=(*job.staged, (ev.checkpoint_id, tx.at))[-MAX_STAGED:])
    if job.run.pending is not None and job.run.pending.step >= ev.step:
        return
    tx.update(job, pending=Pending(checkpoint_id=ev.checkpoint_id, step=ev.step, at=tx.at, nodes=tuple(ev.nodes)))


def staged_at(job: Job, checkpoint_id: str) -> float:
    """When every rank had staged `checkpoint_id` (0.0 if its CheckpointPending was not seen)."""
    return next((at for cid, at in job.staged if cid == checkpoint_id), 0.0)


def settled(tx: Tx, ev: CheckpointCommitted | CheckpointFailed) -> None:
    """The pending checkpoint committed or failed: a restart waiting for it goes ahead (restoring it, if it
    committed: the newest checkpoint is what a restart restores)."""
    job = tx.jobs.get(ev.job_id)
    if job is None:
        return
    cid = ev.checkpoint_id
    if any(c == cid for c, _ in job.staged):
        job = tx.update(job, staged=tuple((c, at) for c, at in job.staged if c != cid))
    pending = job.run.pending
    if pending is not None and (pending.checkpoint_id == cid or (not cid and pending.step == ev.step)):
        job = tx.update(job, pending=None)
    saved = job.waits_for == STOP_SAVE and (isinstance(ev, CheckpointFailed) or ev.attempt == job.attempt - 1)
    memory = isinstance(ev, CheckpointFailed) or (ev.from_memory and ev.attempt == job.memory_from)
    saved = saved or (job.waits_for == MEMORY and memory)
    if memory and job.memory_from >= 0:
        job = tx.update(job, **MEMORY_DONE)
    if job.waits_for and (job.waits_for == cid or not cid or saved):
        why = f"restore checkpoint {cid}, which committed while the restart waited" \
            if isinstance(ev, CheckpointCommitted) else \
            f"checkpoint {cid or job.waits_for} failed while the restart waited: restoring the newest committed"
        tx.update(job, waits_for="", wait_until=0.0, ask_reason=why)


def hold(tx: Tx, job: Job, p: Pending | None, running_since: float, lost_node: str) -> Job:
    """Keep the restart of `job` (its new attempt set) waiting for `p`, the failed attempt's pending checkpoint
    (that attempt ran since `running_since`), if that saves work; says so in a JobQueued."""
    newest = job.newest
    if p is None or (newest is not None and newest.step >= p.step) or job.spec.policy.commit_wait_s <= 0:
        return job
    if lost_node in p.nodes:  # the lost node's agent may never store its ranks' shards
        return job
    # The steps a restore of `newest` redoes were trained between its staging and p's (its commit may have come
    # later than p's staging: uploads slower than training).
    redo_s = p.at - max((newest.staged_at or newest.at) if newest is not None else 0.0, running_since)
    wait_s = min(job.spec.policy.commit_wait_s, redo_s)
    if wait_s <= 0:
        return job
    since = newest.step if newest is not None else 0
    return wait(tx, job, p.checkpoint_id, wait_s,
                 f"restart waits up to {wait_s:.2f}s for checkpoint {p.checkpoint_id} (step {p.step}) to commit: "
                 f"restoring {'step ' + str(since) if newest else 'from scratch'} would redo {p.step - since} steps "
                 f"that took {redo_s:.2f}s")


def wait(tx: Tx, job: Job, what: str, wait_s: float, reason: str) -> Job:
    """The restart of `job` waits for `what` at most `wait_s`, said in a JobQueued (its phase's reason stays the
    fault it recovers from)."""
    tx.emit(JobQueued(job_id=job.job_id, priority=job.spec.priority, reason=reason))
    return tx.update(job, waits_for=what, wait_until=tx.at + wait_s)


def hold_for_save(tx: Tx, job: Job) -> Job:
    """Keep the restart of `job` waiting for the checkpoint its stopped ranks saved (STOP_SAVE), at most
    policy.commit_wait_s: a drain or `flightdeck down` must not cost the steps since the last commit."""
    wait_s = job.spec.policy.commit_wait_s
    if wait_s <= 0:
        return job
    return wait(tx, job, STOP_SAVE, wait_s,
                 f"restart waits up to {wait_s:.2f}s for the checkpoint the stopped ranks saved")


def hold_for_memory(tx: Tx, job: Job, running_since: float, trained_until: float = 0.0, *,
                    unsettled: frozenset[int] = frozenset(), where: tuple[SlotRef, ...] = (),
                    staged: bool = False) -> Job:
    """Keep the restart of `job` (its new attempt set) waiting for the set its failed attempt's agents persist
    from the ranks' snapshots, when the spec takes them: at most policy.commit_wait_s, and never longer than the
    failed attempt trained past the newest checkpoint (waiting can cost at most what it may save). A failed
    attempt that never ran waits again for an earlier one's set still awaited (a node found lost only after the
    first restart: the checkpoint service settles that set once it knows). `trained_until`: when the failed
    attempt last made progress, if before now (a hung rank's time stalled is nothing to save). `unsettled`: ranks
    of the failed attempt with no recorded end, so a node of theirs may be lost: a restart placed before that is
    known may land on it, and a lost node's survivors' set commits only once it is known, so a wait that may save
    anything lasts up to the lost deadline while one of them is owed (`exits_owed`). Found by bench/vs_peers.py:
    a wait bounded by 1.6 s of training ended 0.1 s before NodeLost, and the restart redid 10 steps. `where`: the
    owed ranks' slots; `staged`: an exit recorded so far said its rank's snapshot was staged. With neither owed nor
    staged ranks, no set can come ("known"): a restart after a lost node waited its whole wait for one (9 s)."""
    known = tx.settings.memory_wait in KNOWN
    if tx.settings.memory_wait not in ("yes", "settled", *KNOWN) or job.spec.train.snapshot_every <= 0 \
            or job.spec.policy.commit_wait_s <= 0:
        return job
    newest = job.newest
    if running_since > 0:
        end = min(tx.at, trained_until) if trained_until > 0 else tx.at
        redo_s = end - max((newest.staged_at or newest.at) if newest is not None else 0.0, running_since)
        job = tx.update(job, memory_from=job.attempt - 1, memory_redo_s=redo_s, memory_staged=staged,
                        memory_where=where)
        if known and not unsettled and not staged:
            return tx.update(job, **MEMORY_DONE)
    elif job.memory_from >= 0:
        redo_s = job.memory_redo_s
    else:
        return job
    wait_s = min(job.spec.policy.commit_wait_s, redo_s)
    if (staged or job.memory_staged) and tx.settings.memory_wait == "promised":
        wait_s = job.spec.policy.commit_wait_s  # an exit said its snapshot is staged: that set is coming
    if wait_s <= 0:
        return job
    if unsettled and running_since > 0 and tx.settings.memory_wait in ("settled", *KNOWN):
        policy = job.spec.policy
        job = tx.update(job, memory_owed=unsettled, memory_until=tx.at + wait_s)
        wait_s = min(policy.commit_wait_s, max(wait_s, policy.heartbeat_interval_s * policy.heartbeat_misses))
    return wait(tx, job, MEMORY, wait_s,
                 f"restart waits up to {wait_s:.2f}s for the failed attempt's snapshots in memory to be persisted: "
                 f"restoring {'step ' + str(newest.step) if newest else 'from scratch'} would redo {redo_s:.2f}s of "
                 "training")


def exits_owed(tx: Tx, ev: WorkersExited) -> None:
    """Exits of the failed attempt's ranks a memory wait was owed: once none is, the wait lasts no longer than
    the training it may save (their nodes are not lost: their agents recorded them), and ends at once when no
    exit said its snapshot was staged ("known")."""
    job = tx.jobs.get(ev.job_id)
    if job is None or job.waits_for != MEMORY or ev.attempt != job.memory_from or not job.memory_owed:
        return
    staged = job.memory_staged or any(x.persisted == "staged" for x in ev.exits())
    if staged and not job.memory_staged and tx.settings.memory_wait == "promised":
        # the evidence promised: its set is coming, so the wait lasts for it (bounded by the policy), not only as
        # long as the training it saves took (a loaded box once persisted the set 0.07 s after that ran out)
        job = tx.update(job, wait_until=max(job.wait_until, tx.at + job.spec.policy.commit_wait_s),
                        memory_until=max(job.memory_until, tx.at + job.spec.policy.commit_wait_s))
    owed_less(tx, tx.update(job, memory_staged=staged), {x.rank for x in ev.exits()}, "their exits say so")


def node_lost(tx: Tx, node: str) -> None:
    """Ranks owed to a memory wait that ran on a node now lost: they leave no exit and no snapshot ("known"). A set
    the survivors staged is settled by the checkpoint service on this same news: the wait goes on for it."""
    if tx.settings.memory_wait not in KNOWN:
        return
    for job in list(tx.jobs.values()):
        gone = {r.rank for r in job.memory_where if r.node == node} & job.memory_owed
        if job.waits_for == MEMORY and gone:
            owed_less(tx, job, gone, f"node {node} was lost", shorten=False)


def owed_less(tx: Tx, job: Job, ranks: set[int], how: str, *, shorten: bool = True) -> None:
    """`ranks` owe the memory wait of `job` nothing more: with none owed and none staged ("known") it ends now;
    with none owed (and `shorten`), it lasts no longer than the training it may save."""
    owed = job.memory_owed - ranks
    if not owed and not job.memory_staged and tx.settings.memory_wait in KNOWN:
        tx.update(job, waits_for="", wait_until=0.0, **MEMORY_DONE,
                  ask_reason=f"no snapshot of attempt {job.memory_from} can be persisted ({how}: none of its ranks "
                             "staged one newer than its checkpoints): restoring the newest committed")
        return
    wait_until = min(job.wait_until, max(tx.at, job.memory_until)) if not owed and shorten else job.wait_until
    tx.update(job, memory_owed=owed, wait_until=wait_until)
    deadlines(tx)  # ended now, if past what it could save: said so before the restart is asked for


def deadlines(tx: Tx) -> None:
    """Restarts whose wait ran out go ahead with the newest committed checkpoint."""
    for job in list(tx.jobs.values()):
        if job.waits_for and tx.at >= job.wait_until and not job.waits_for.startswith(READ):
            what = "the failed attempt's snapshots in memory were not persisted and committed" \
                if job.waits_for == MEMORY else f"checkpoint {job.waits_for} did not commit"
            tx.update(job, waits_for="", wait_until=0.0, ask_reason=f"{what} in time: restoring the newest committed")


# A memory wait's bookkeeping once its set came, failed or cannot come.
MEMORY_DONE: dict[str, object] = {"memory_from": -1, "memory_redo_s": 0.0, "memory_owed": frozenset(),
                                  "memory_until": 0.0, "memory_where": (), "memory_staged": False}


def waiting(job: Job, now: float) -> bool:
    return bool(job.waits_for) and now < job.wait_until
