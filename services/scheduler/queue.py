"""Admission: who gets slots next, and whom to preempt for them.

Why it works this way: docs/internals.md, "3. The scheduler and its recovery recipes".
"""

from flightdeck.events import spec as spec_mod
from flightdeck.events.commands import StopRequested
from flightdeck.events.job import AllocationRequested, JobPreempted, RestorePoint
from flightdeck.services.scheduler import commit_wait, recipes
from flightdeck.services.scheduler.policy import Victim, choose_victims, work_lost_s
from flightdeck.services.scheduler.state import Job
from flightdeck.services.scheduler.tx import Tx


def capacity(tx: Tx, spares: bool) -> int:
    return sum(v.slots for v in tx.nodes.values() if v.usable(spares))


def held(tx: Tx, job: Job, spares: bool) -> int:
    """Slots `job` holds on nodes usable for a job that may (or may not) use spares."""
    nodes = tx.nodes
    return sum(1 for r in job.run.assignments if r.node in nodes and nodes[r.node].usable(spares)
               and r.slot < nodes[r.node].slots)


def free(tx: Tx, spares: bool) -> int:
    """Usable slots nobody holds or has asked for."""
    live = tx.live()
    used = sum(held(tx, j, spares) for j in live)
    asked = sum(j.size for j in live if j.run.requested and not j.run.assignments)
    return capacity(tx, spares) - used - asked


def admit(tx: Tx) -> None:
    """Ask for slots for every job at the head of the queue that fits; preempt for the first that does not."""
    room: dict[bool, int] = {}  # free slots without / with spares, counted once per pass
    for job_id in list(tx.queue):
        job = tx.jobs[job_id]
        if commit_wait.waiting(job, tx.at):  # its restart waits for a commit: nothing behind it jumps ahead
            break
        full, lo, fleet = job.spec.slots, recipes.smallest(job), capacity(tx, job.run.use_spares)
        if lo > fleet:
            continue
        top = min(full, fleet) if job.denied_epoch != tx.epoch else min(full, fleet, job.denied_world - 1)
        if top < lo:
            break
        if job.run.use_spares not in room:
            room[job.run.use_spares] = free(tx, job.run.use_spares)
        have = room[job.run.use_spares]
        if top == full and have < full:
            preempt_for(tx, job, full - have)
            break
        if top < full and have < lo:
            preempt_for(tx, job, lo - have)
            break
        world = full if top == full else recipes.pick_world(lo, min(top, have), job.spec.train.batch_size)
        request(tx, job, world, "" if world == full else recipes.shrink_reason(job, world, fleet))
        room = {spares: left - world for spares, left in room.items()}


def request(tx: Tx, job: Job, world: int, reason: str) -> None:
    tx.dequeue(job.job_id)
    why = reason or job.run.ask_reason
    recovering = job.phase == "recovering"
    chosen = tx.settings.restores == "requested"
    restore = job.newest if chosen else None  # chosen once, here: the grant carries it to the agents
    tx.update(job, phase="recovering" if recovering else "placing", why=job.why if recovering else "", requested=True,
              asked_epoch=tx.epoch, world=0 if world == job.spec.slots else world, ask_reason="", waits_for="",
              wait_until=0.0, restore=restore)
    point = None if restore is None else RestorePoint(
        checkpoint_id=restore.checkpoint_id, step=restore.step, manifest_sha256=restore.manifest_sha256,
        attempt=restore.attempt, from_memory=restore.from_memory, skips=list(job.skips_of(restore)))
    tx.emit(AllocationRequested(job_id=job.job_id, slots=world, attempt=job.attempt, use_spares=job.run.use_spares,
                                reason=why, snapshot_bytes=snapshot_bytes(job), restore=point, restore_chosen=chosen))


def snapshot_bytes(job: Job) -> int:
    """One rank's host snapshot: as the newest checkpoint that recorded it says, else as the spec says."""
    if job.spec.train.snapshot_every == 0:
        return 0
    recorded = next((c.rank_bytes for c in reversed(job.checkpoints) if c.rank_bytes > 0), 0)
    return recorded or spec_mod.snapshot_bytes(job.spec)


def can_grow(tx: Tx, job: Job) -> bool:
    """Whether the free usable slots (spares aside) and the job's own would hold its whole gang, with no job
    waiting that could use them and ranks as high as it or higher."""
    if free(tx, False) + held(tx, job, False) < job.spec.slots:
        return False
    fleet = capacity(tx, False)
    return not any(tx.jobs[j].spec.priority >= job.spec.priority and recipes.smallest(tx.jobs[j]) <= fleet
                   for j in tx.queue)


def preempt_for(tx: Tx, head: Job, short: int) -> None:
    """Stop lower-priority running jobs so that `short` more slots free up for `head`, unless stops
    already in flight will free enough."""
    live = tx.live()
    running = [j for j in live if j.phase == "running" and not j.run.stop and j.spec.priority < head.spec.priority]
    if not running:
        return
    incoming = sum(held(tx, j, head.run.use_spares) for j in live if j.run.stop)
    if incoming >= short:
        return
    candidates = [Victim(job_id=j.job_id, priority=j.spec.priority, work_lost_s=work_lost_s(j, tx.at),
                         slots=held(tx, j, head.run.use_spares), order=j.order) for j in running]
    for victim_id in choose_victims(candidates, short - incoming, head.spec.priority):
        victim = tx.jobs[victim_id]
        reason, needs = f"preempted by {head.job_id}", f"{head.job_id} (priority {head.spec.priority}) needs " \
            f"{head.spec.slots} slots"
        tx.emit(StopRequested(job_id=victim_id, checkpoint=True, reason=reason))
        tx.emit(JobPreempted(job_id=victim_id, by_job_id=head.job_id, reason=needs))
        tx.update(victim, phase="stopping", why=f"{reason}: {needs}", stop="preempt", stop_reason=reason,
                  stop_since=tx.at, preempted_by=head.job_id)
