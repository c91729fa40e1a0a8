"""Job lifecycle: submission, queueing, placement, workers, and how a job ends."""

import msgspec

from events.base import JobEvent
from events.spec import JobSpec


class SlotRef(msgspec.Struct, frozen=True, kw_only=True):
    """One slot (a GPU, or a CPU slot on a machine without GPUs) on one node, bound to a rank."""

    node: str
    slot: int
    rank: int


class JobSubmitted(JobEvent, frozen=True, kw_only=True):
    spec: JobSpec


class JobQueued(JobEvent, frozen=True, kw_only=True):
    priority: int
    reason: str = ""  # "submitted", "preempted", "waiting for slots", ...


class AllocationRequested(JobEvent, frozen=True, kw_only=True):
    slots: int
    attempt: int
    use_spares: bool = False  # a replacement after a fault may take slots held back as spares
    tp: int = 1  # tensor-parallel group size: each group of tp consecutive ranks stays on one node
    reason: str = ""  # why this size, when it is not the spec's slots (a shrink) or why asked again (grow back)


class AllocationGranted(JobEvent, frozen=True, kw_only=True):
    attempt: int
    assignments: list[SlotRef]
    master_addr: str = "127.0.0.1"
    master_port: int = 0


class AllocationDenied(JobEvent, frozen=True, kw_only=True):
    attempt: int
    reason: str


class AllocationReleased(JobEvent, frozen=True, kw_only=True):
    attempt: int
    reason: str = ""


class WorkersStarted(JobEvent, frozen=True, kw_only=True):
    node: str
    attempt: int
    ranks: list[int]
    pids: list[int]


class WorkersExited(JobEvent, frozen=True, kw_only=True):
    node: str
    attempt: int
    rank: int
    exit_code: int  # negative: killed by that signal
    # Why, in the agent's words, for a failed rank: why it could not be started, or the last lines it printed
    # (a traceback), so status and postmortems show it without the node's disk.
    cause: str = ""
    unrunnable: bool = False  # the command cannot be found or executed: no restart can help


class JobResumed(JobEvent, frozen=True, kw_only=True):
    attempt: int
    from_step: int
    checkpoint_id: str = ""
    world_size: int


class JobPreempted(JobEvent, frozen=True, kw_only=True):
    by_job_id: str
    reason: str = ""


class JobCompleted(JobEvent, frozen=True, kw_only=True):
    steps: int


class JobFailed(JobEvent, frozen=True, kw_only=True):
    reason: str
    causes: list[str] = []  # event ids from the first fault to the last straw


class CancelRequested(JobEvent, frozen=True, kw_only=True):
    reason: str = ""


class JobCancelled(JobEvent, frozen=True, kw_only=True):
    reason: str = ""
