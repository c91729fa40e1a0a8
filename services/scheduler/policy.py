"""Recovery recipes and the preemption rule, as pure functions of what the scheduler knows.

Why it works this way: docs/internals.md, "3. The scheduler and its recovery recipes".
"""

from collections.abc import Sequence
from dataclasses import dataclass

from flightdeck.events.findings import RankHung, RankLost, StragglerDetected
from flightdeck.events.job import RankExit, WorkersExited, failed
from flightdeck.events.nodelocal import RESTORE_REFUSED_EXIT, STOPPED_EXIT
from flightdeck.services.scheduler.state import Job


@dataclass(frozen=True, slots=True)
class Restart:
    reason: str


@dataclass(frozen=True, slots=True)
class Fail:
    reason: str
    causes: tuple[str, ...] = ()  # the findings that made the job fail, when they are not its restart faults


Recovery = Restart | Fail


def fault_reason(event: WorkersExited | RankLost | RankHung | StragglerDetected) -> str:
    """Why an input counts as a fault, in words for the record ("" if it is not one)."""
    match event:
        case WorkersExited(rank=rank, exit_code=code, cause=cause, unrunnable=unrunnable, others=others) \
                if failed(event.exits()[0]):
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            if code == STOPPED_EXIT:
                how = (f"stopped before its last step (exit {code}: a SIGTERM from outside the platform, e.g. an "
                       "eviction or a node shutting down, or a script that left run.steps() early)")
            if unrunnable:
                how = "could not be started"
            if event.unlinked and code == 0:  # a failed one's error says more
                how += " without calling flightdeck.init()"
            also = [x.rank for x in others if failed(x)]
            which = f"rank {also[0]}" if len(also) == 1 else f"ranks {', '.join(map(str, also))}"
            with_them = f" (with {which} on {event.node})" if also else ""
            said = event.error or quoted(cause)  # the error itself when the agent found it, else the last lines
            return f"rank {rank} {how}{with_them}" + (f": {said}" if said else "")
        case RankLost(rank=rank, reason=why):
            return f"rank {rank} lost: {why}"
        case RankHung(rank=rank, step=step, stalled_s=stalled, deadline_s=deadline):
            return f"rank {rank} hung at step {step}: no progress for {stalled:.0f}s (deadline {deadline:.0f}s)"
        case StragglerDetected(rank=rank, step_time_s=took, peer_median_s=median, factor=factor):
            return (f"rank {rank} straggler replaced: steps take {took:.3g}s against a peer median of {median:.3g}s "
                    f"({factor:.1f}x)")
    return ""


QUOTED_CHARS = 1500  # of a rank's last output, in a decision's reason (the whole tail is in WorkersExited.cause)


def quoted(text: str) -> str:
    """The end of a rank's output (or an agent's explanation) as it goes into a reason."""
    text = text.strip()
    return text if len(text) <= QUOTED_CHARS else "..." + text[-QUOTED_CHARS:]


def after_bad_checkpoint(job: Job, reason: str) -> Recovery:
    """The attempt could not start because its checkpoint is bad: restart from the newest good one without
    spending the restart budget (the bad one is out of the catalog already), or fail once if none is left. A node's
    claim (Settings.claims "verify") decides nothing yet: the restart waits for the service's read (claims.py)."""
    if job.run.claimed:
        return Restart(f"{job.run.bad_restore}; restarting once the checkpoint service has read it back from the "
                       "store, without spending the restart budget")
    good = job.newest
    if good is None:
        return Fail(f"{job.run.bad_restore}; no good checkpoint is left to restore ({reason})")
    return Restart(f"{job.run.bad_restore}; restarting from {good.checkpoint_id} (step {good.step}), the newest good "
                   "checkpoint, without spending the restart budget")


def early_way(x: RankExit) -> str:
    """How a rank failed before its first step, in words compared across attempts ("" if it did not, or if its
    way says nothing of the code: a signal or a stop from outside, a checkpoint it refused)."""
    if not x.early or x.exit_code < 0 or x.exit_code in (STOPPED_EXIT, RESTORE_REFUSED_EXIT) or x.unrunnable:
        return ""
    return f"exit {x.exit_code}" + (" without calling flightdeck.init()" if x.unlinked else "") + \
        (f": {x.error}" if x.error else "")


NEVER_HEARD = "no sign of life since its start: it never called flightdeck.init()"


def no_retry(job: Job, x: RankExit) -> str:
    """Why no restart can help a rank's failure ("" if one may): the trainer API refused the script's call, or
    the attempt failed before its first step exactly as the one before it did (policy.fail_fast)."""
    if not job.spec.policy.fail_fast:
        return ""
    if x.usage:
        return "not restarted: the trainer API refused the script's call, and a restart runs the same code"
    return same_again(job, early_way(x))


def same_again(job: Job, way: str) -> str:
    if job.spec.policy.fail_fast and way and way == job.early_failure:
        return (f"not restarted: attempt {job.attempt - 1} failed the same way before its first step, so a restart "
                "cannot fix it")
    return ""


def after_fault(job: Job, reason: str) -> Recovery:
    """Restart while the budget lasts (policy.max_restarts restarts), then fail."""
    budget = job.spec.policy.max_restarts
    if job.restarts < budget:
        return Restart(f"{reason}; restart {job.restarts + 1} of {budget}")
    return Fail(f"{reason}; restart budget of {budget} spent")


@dataclass(frozen=True, slots=True)
class Victim:
    """A running job that could be preempted, with what stopping it would free and cost."""

    job_id: str
    priority: int
    work_lost_s: float
    slots: int  # slots it holds that the waiting job could use
    order: int


def cost(v: Victim) -> tuple[int, float, int, int]:
    return (v.priority, v.work_lost_s, v.slots, -v.order)


def choose_victims(candidates: Sequence[Victim], need: int, priority: int) -> tuple[str, ...]:
    """The job ids to preempt so that `need` more slots free up for a job of `priority`; () if no set of
    lower-priority jobs can free that many."""
    eligible = sorted((v for v in candidates if v.priority < priority and v.slots > 0), key=cost)
    chosen: list[Victim] = []
    freed = 0
    for v in eligible:
        if freed >= need:
            break
        chosen.append(v)
        freed += v.slots
    if freed < need:
        return ()
    for v in reversed(list(chosen)):
        if freed - v.slots >= need:
            chosen.remove(v)
            freed -= v.slots
    return tuple(v.job_id for v in chosen)


def work_lost_s(job: Job, now: float) -> float:
    """Seconds of progress a stop would lose if no new checkpoint were taken."""
    newest = job.newest
    since = max(job.run.running_since, newest.at) if newest is not None else job.run.running_since
    return max(0.0, now - since)
