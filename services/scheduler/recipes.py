"""Recovery recipes beyond a plain restart, as pure functions of a job; recovery.py and queue.py carry them out.

Why it works this way: docs/internals.md, "3. The scheduler and its recovery recipes".
"""

from dataclasses import dataclass

from flightdeck.events import lineage
from flightdeck.events.checkpoint import DataPosition
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss, nonfinite_summary, spike_onset, spike_summary
from flightdeck.services.scheduler.policy import Fail
from flightdeck.services.scheduler.state import Checkpoint, Incident, Job

LossFinding = LossSpikeDetected | NonFiniteLoss
SPIKES_TO_FAIL = 3  # spikes in one incident: the third fails the job


@dataclass(frozen=True, slots=True)
class Ask:
    """A rollback the policy does not allow alone: the job is paused and the operator asked (`reason` says how)."""

    reason: str


@dataclass(frozen=True, slots=True)
class RollTo:
    checkpoint: Checkpoint
    skip_from: int
    skip_to: int
    reason: str
    incident: Incident | None  # the loss incident it answers; None: an operator's rollback, which starts none
    replay: bool = False  # the spike's batches are trained again first, for its diagnosis (policy.spike_diagnosis)


# -- shrink ------------------------------------------------------------------------------------------------

def shrinkable(job: Job) -> bool:
    floor = job.spec.policy.min_slots
    return job.phase in ("recovering", "preempted") and 0 < floor < job.spec.slots


def smallest(job: Job) -> int:
    """The fewest slots the job may be started with now."""
    return job.spec.policy.min_slots if shrinkable(job) else job.spec.slots


def pick_world(lo: int, hi: int, batch_size: int) -> int:
    """The largest world size in [lo, hi] that divides the global batch, else `hi`."""
    assert 1 <= lo <= hi, (lo, hi)
    return next((w for w in range(hi, lo - 1, -1) if batch_size % w == 0), hi)


def shrink_reason(job: Job, world: int, capacity: int) -> str:
    full = job.spec.slots
    why = (f"the usable nodes hold {capacity} slots" if capacity < full
           else f"an allocation of {job.denied_world} slots was denied at this capacity")
    after = f" (after fault {job.faults[-1]})" if job.faults else ""
    return f"shrink to {world} of {full} slots: {why}; policy.min_slots is {job.spec.policy.min_slots}{after}"


# -- rollbacks ---------------------------------------------------------------------------------------------

def merged(windows: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Skip windows as sorted, disjoint, non-adjacent spans (the trainer jumps across touching ones at once)."""
    spans: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in windows if b > a):
        if spans and a <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    return spans


def batch_after(position: DataPosition, later: tuple[tuple[int, int], ...], n: int) -> int:
    """The batch index the n-th step (from 0) after a checkpoint at `position` reads, skipping the windows it
    recorded and the `later` ones rollbacks added since."""
    index, left = position.next_batch, n
    for a, b in merged((*position.skipped, *later)):
        if b <= index:
            continue
        if a > index:
            if left < a - index:
                return index + left
            left -= a - index
        index = b
    return index + left


def rollback_target(job: Job, step: int) -> tuple[Checkpoint | None, bool]:
    """The checkpoint to roll back to for a spike at `step`, and whether it is as old as the policy asks."""
    usable = [c for c in job.checkpoints if c.checkpoint_id not in job.abandoned and c.step <= step
              and not lineage.thrown_away(job.forks, c.attempt, c.timeline, c.step)]
    old = [c for c in usable if c.step <= step - job.spec.policy.rollback_steps_back]
    if old:
        return max(old, key=lambda c: (c.step, c.at)), True
    return (min(usable, key=lambda c: (c.step, c.at)) if usable else None), False


def newest_at_or_before(job: Job, step: int) -> Checkpoint | None:
    """The newest committed checkpoint at or before `step` that no rollback threw away (an operator's target)."""
    usable = [c for c in job.checkpoints if c.checkpoint_id not in job.abandoned and c.step <= step
              and not lineage.thrown_away(job.forks, c.attempt, c.timeline, c.step)]
    return max(usable, key=lambda c: (c.step, c.at)) if usable else None


def onset(ev: LossFinding) -> int:
    """The first step whose loss carried the finding's evidence: a spike found over several steps began before the
    step that completed it (LossSpikeDetected v1 and NonFiniteLoss name one step)."""
    return spike_onset(ev) if isinstance(ev, LossSpikeDetected) else ev.step


def symptom(ev: LossFinding) -> str:
    match ev:
        case LossSpikeDetected():
            return spike_summary(ev)
        case NonFiniteLoss():
            return nonfinite_summary(ev)


def skipped(windows: tuple[tuple[int, int], ...]) -> int:
    """Batches the windows skip, overlaps counted once."""
    return sum(b - a for a, b in merged(windows))


def after_loss(job: Job, ev: LossFinding) -> RollTo | Fail | Ask:
    """The rollback a loss finding calls for, why the job must fail instead, or why the operator must decide."""
    policy, step, first, what = job.spec.policy, ev.step, onset(ev), symptom(ev)
    incident = job.incident
    same = incident is not None and incident.first <= step <= incident.last
    if incident is not None and same and len(incident.triggers) + 1 >= SPIKES_TO_FAIL:
        steps = ", ".join(str(s) for s in (*incident.steps, step))
        return Fail(f"loss spiked {len(incident.triggers) + 1} times around step {incident.steps[0]} despite "
                    f"rollbacks (steps {steps}; last: {what}): a data or learning-rate problem; check the data "
                    f"from batch {incident.skip_from} on, or lower train.lr", causes=(*incident.triggers, ev.event_id))
    target, old_enough = rollback_target(job, first)  # a checkpoint after the onset holds the spike's updates
    if target is None:
        return Fail(f"{what} before any checkpoint at or before it was committed: nothing to roll back to; "
                    f"checkpoint more often (train.checkpoint_every is {job.spec.train.checkpoint_every}) or start "
                    f"spike detection later (policy.spike_warmup is {policy.spike_warmup})", causes=(ev.event_id,))
    position = target.data or DataPosition(next_batch=target.step)
    spike_batch = batch_after(position, job.run.skips, first - target.step)
    evidence = batch_after(position, job.run.skips, step - target.step) + 1 - spike_batch  # the batches that carried it
    margin = max(policy.rollback_steps_back, job.spec.train.checkpoint_every)
    if incident is not None and same:
        length = incident.skip_to - incident.skip_from
        skip_from, skip_to = incident.skip_from, incident.skip_from + 2 * length
        if length:  # and at least as far past the new spike's batch as the first window ran past the first's
            skip_to = max(skip_to, spike_batch + length)
        incident = Incident(first=min(incident.first, target.step), last=max(incident.last, step + margin),
                            skip_from=skip_from, skip_to=skip_to, steps=(*incident.steps, step),
                            triggers=(*incident.triggers, ev.event_id))
        how = f"; spike {len(incident.triggers)} around step {incident.steps[0]}, so the skip is widened"
    else:
        skip_from, skip_to = spike_batch, spike_batch + evidence + policy.rollback_skip_batches
        incident = Incident(first=target.step, last=step + margin, skip_from=skip_from, skip_to=skip_to,
                            steps=(step,), triggers=(ev.event_id,))
        how = ""
    if not old_enough:
        how += (f"; no checkpoint is {policy.rollback_steps_back} steps older than the spike "
                f"(policy.rollback_steps_back), so the oldest one before it")
    total, cap = skipped((*job.run.skips, (skip_from, skip_to))), policy.max_skip_fraction * job.spec.train.steps
    if total > cap:
        return Ask(f"{what}: rolling back to {target.checkpoint_id} (step {target.step}) and skipping batches "
                   f"[{skip_from}, {skip_to}) would skip {total} batches in all, {total / job.spec.train.steps:.1%} of "
                   f"the run's {job.spec.train.steps}, past policy.max_skip_fraction {policy.max_skip_fraction:g}: "
                   f"paused for the operator; to roll back anyway: flightdeck rollback {job.job_id} --to-step "
                   f"{target.step} --skip {skip_from}:{skip_to}, then flightdeck resume {job.job_id}; to go on as it "
                   f"is: flightdeck resume {job.job_id} (finding {ev.event_id})")
    reason = (f"{what}: roll back to {target.checkpoint_id} (step {target.step}) and skip batches "
              f"[{skip_from}, {skip_to}){how} (finding {ev.event_id})")
    # A spike's first rollback re-runs its batches when the policy asks: what caused it is judged once, per incident.
    replay = policy.spike_diagnosis and isinstance(ev, LossSpikeDetected) and not same
    if replay:
        reason += "; its batches are trained again first, to diagnose it (policy.spike_diagnosis)"
    return RollTo(checkpoint=target, skip_from=skip_from, skip_to=skip_to, reason=reason, incident=incident,
                  replay=replay)


def reroll(job: Job, why: str) -> RollTo | Fail:
    """The rollback in flight decided again once its checkpoint was found bad (`why`; it has left the catalog):
    the newest good checkpoint the recipe allows for the same spike, skipping the same batches. Not another spike
    of the incident; a job with no good checkpoint left fails once."""
    incident, rb, policy = job.incident, job.run.rollback, job.spec.policy
    assert incident is not None and rb is not None, "a rollback in flight has its incident"
    spike = incident.steps[-1]
    target, old_enough = rollback_target(job, spike)
    if target is None:
        return Fail(f"{why}; no good checkpoint is left to roll back to for the loss spike at step {spike}",
                    causes=incident.triggers)
    how = "" if old_enough else (f"; none is {policy.rollback_steps_back} steps older than the spike "
                                 "(policy.rollback_steps_back), so the oldest one before it")
    reason = (f"{why}; roll back to {target.checkpoint_id} (step {target.step}) instead, the newest good checkpoint "
              f"for the spike at step {spike}, and skip batches [{rb.skip_from}, {rb.skip_to}) as planned{how}")
    incident = Incident(first=min(incident.first, target.step), last=incident.last, skip_from=incident.skip_from,
                        skip_to=incident.skip_to, steps=incident.steps, triggers=incident.triggers)
    return RollTo(checkpoint=target, skip_from=rb.skip_from, skip_to=rb.skip_to, reason=reason, incident=incident)
