"""Commands to a job's ranks, obeyed at step boundaries; recorded in the job's history like any decision."""

from flightdeck.events.base import JobEvent


class CheckpointRequested(JobEvent, frozen=True, kw_only=True):
    reason: str = ""


class RollbackRequested(JobEvent, frozen=True, kw_only=True):
    checkpoint_id: str
    to_step: int
    skip_from: int  # batch window [skip_from, skip_to) the ranks skip after restoring
    skip_to: int
    reason: str
    trigger_id: str = ""
    attempt: int = 0  # the attempt whose ranks are to roll back
    # train the spike's batches again from the checkpoint first (policy.spike_diagnosis), report their losses in
    # SpikeReplayed, then restore the checkpoint again and skip
    replay: bool = False


class StopRequested(JobEvent, frozen=True, kw_only=True):
    checkpoint: bool = True  # take a final checkpoint before exiting
    reason: str = ""


class PauseRequested(JobEvent, frozen=True, kw_only=True):
    reason: str = ""


class ResumeRequested(JobEvent, frozen=True, kw_only=True):
    reason: str = ""
