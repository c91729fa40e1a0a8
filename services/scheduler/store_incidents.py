"""What the scheduler does when the store refuses a job's checkpoints (CheckpointsFailing, the checkpoint service's
finding): the job's policy.on_checkpoint_failures decides. "continue": it trains on, and the risk is the reason of
its running phase until CheckpointsRecovered (a crash meanwhile goes back to the newest saved step, which the
reason names); "pause": its ranks are paused and the operator asked to fix the store and resume it."""

from flightdeck.events.checkpoint import CheckpointsFailing, CheckpointsRecovered
from flightdeck.events.commands import PauseRequested
from flightdeck.services.scheduler.tx import Tx


def failing(tx: Tx, ev: CheckpointsFailing) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is None:
        return
    saved = f"the newest saved step is {ev.newest_step}" if ev.newest_step >= 0 else "no step is saved"
    what = (f"checkpoints failing: the store refused {ev.failures} in a row since step {ev.first_step} "
            f"({ev.reason[:300]}); {saved}")
    if job.spec.policy.on_checkpoint_failures == "pause":
        if job.phase == "running" and not job.run.paused and not job.run.stop:
            tx.emit(PauseRequested(job_id=job.job_id, reason=f"{what}: paused (policy.on_checkpoint_failures); free "
                                                              f"the store or fix its access, then `flightdeck resume "
                                                              f"{job.job_id}`"))
        return
    tx.update(job, at_risk=f"{what}: training on at that risk (policy.on_checkpoint_failures)")


def recovered(tx: Tx, ev: CheckpointsRecovered) -> None:
    job = tx.jobs.get(ev.job_id)
    if job is not None and job.at_risk:
        tx.update(job, at_risk="")
