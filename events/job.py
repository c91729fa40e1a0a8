"""Job lifecycle: submission, queueing, placement, workers, and how a job ends."""

from typing import Literal

import msgspec

from flightdeck.events.base import JobEvent
from flightdeck.events.spec import JobSpec


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


class RestorePoint(msgspec.Struct, frozen=True, kw_only=True):
    """The committed checkpoint an attempt restores, as the scheduler chose it when it asked for the attempt's slots
    (the newest of the job's current timeline: events/lineage.py): what the node agents start its ranks from."""

    checkpoint_id: str
    step: int
    manifest_sha256: str = ""
    attempt: int = 0  # the attempt that staged it: snapshots of attempts before it are never needed again
    from_memory: bool = False  # persisted from the ranks' snapshots: a node holding them restores from memory
    skips: list[tuple[int, int]] = []  # batch windows rollbacks skipped beyond the checkpoint's own data position


class AllocationRequested(JobEvent, frozen=True, kw_only=True):
    slots: int
    attempt: int
    use_spares: bool = False  # a replacement after a fault may take slots held back as spares
    tp: int = 1  # tensor-parallel group size: each group of tp consecutive ranks stays on one node
    reason: str = ""  # why this size, when it is not the spec's slots (a shrink) or why asked again (grow back)
    # One rank's host snapshot (train.snapshot_every), as the job's newest checkpoint or its spec says: what each
    # of its ranks takes of a node's snapshot memory is twice this and a margin (events/snapshot.py). 0: unknown.
    snapshot_bytes: int = 0
    restore: RestorePoint | None = None  # what the attempt restores; None: no checkpoint of its own (its init_from)
    # The scheduler chose `restore` (None included). False: a request from before it did, whose grant leaves the
    # choice to the agents (a service-by-service upgrade: they apply the same rule, events/lineage.py)
    restore_chosen: bool = False


class AllocationGranted(JobEvent, frozen=True, kw_only=True):
    attempt: int
    assignments: list[SlotRef]
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Nodes whose snapshot memory cannot hold these ranks' snapshots besides what it holds already, and why: their
    # ranks take none (each records SnapshotsOff with this reason), and a failure there restores from the store.
    snapshots_off: dict[str, str] = {}
    restore: RestorePoint | None = None  # the request's: the agents start the ranks from it, choosing nothing
    restore_chosen: bool = False  # the request's: False when it made no choice (see AllocationRequested)


class AllocationDenied(JobEvent, frozen=True, kw_only=True):
    attempt: int
    reason: str


ReleaseKind = Literal["", "fault", "grow", "preempt", "ended", "stale"]


class AllocationReleased(JobEvent, frozen=True, kw_only=True):
    attempt: int
    reason: str = ""
    restarts: int = -1  # the restarts of its budget the job has spent, this one included (-1: not recorded)
    # Why, as the scheduler decided it: "fault" (a restart after a fault, whether it cost the budget or not), "grow"
    # (a shrunk job stopped to grow back), "preempt", "ended" (completed, failed or cancelled), "stale" (a grant
    # nobody waits for); "" in records written before it said so, which views read by the reason alone
    kind: ReleaseKind = ""


class WorkersStarted(JobEvent, frozen=True, kw_only=True):
    node: str
    attempt: int
    ranks: list[int]
    pids: list[int]


Persisted = Literal["", "staged", "none"]


class RankExit(msgspec.Struct, frozen=True, kw_only=True):
    """How one rank ended: its exit code (negative: killed by that signal) and, for a failed rank, why."""

    rank: int
    exit_code: int
    cause: str = ""
    unrunnable: bool = False
    planned: bool = False  # its agent stopped it while shutting down (a drain, `flightdeck down`): not the job's fault
    # What it died of in one line: its uncaught error as the rank recorded it, else what its output names as the error
    # (its traceback's exception, or its last line naming one: services/agent/rankproc.error_of); "" if none does.
    error: str = ""
    early: bool = False  # it ended before completing a step of its attempt (as far as its agent heard)
    usage: bool = False  # its error was the trainer API refusing a call (RankFault.usage): no restart helps
    unlinked: bool = False  # it never called flightdeck.init(): an exit 0 then is no completion
    # What its agent did with its host snapshots as it ended without finishing (services/agent/snapshots.py): staged
    # the newest for the store, or had none newer than its checkpoints, so none of its can come; "": not said (it
    # finished, or its node keeps no snapshots). A restart waiting for a set from memory stops when none can come.
    persisted: Persisted = ""
    # ... and for "staged", the newest (timeline, step) it staged: no set of a newer step can hold this rank, so the
    # survivors' replicas settle it without (services/checkpoints/core.py `_survivors`). None: not said.
    persisted_at: tuple[int, int] | None = None
    # It died with its agent (killed with it, or lost when it crashed) and the next agent on its node recorded it
    # (services/agent/main.py `reconcile`): the agent's fault, not the job's.
    orphaned: bool = False


class WorkersExited(JobEvent, frozen=True, kw_only=True):
    """Ranks of one attempt that ended on one node. An agent records the ranks it stops together, so a restart
    appends one of these per node, not per rank. `rank` and the fields after it are the record's first failed
    rank (or its first rank when none failed); `others` are the rest, by rank."""

    # 2 added `others`, 3 `error`, `early`, `usage`, `unlinked`, 4 `persisted`, 5 `persisted_at`, 6 `orphaned`; written
    # at the least version it needs
    SCHEMA = 6

    node: str
    attempt: int
    rank: int
    exit_code: int  # negative: killed by that signal
    # Why, in the agent's words, for a failed rank: why it could not be started, or the last lines it printed
    # (a traceback), so status and postmortems show it without the node's disk.
    cause: str = ""
    unrunnable: bool = False  # the command cannot be found or executed: no restart can help
    others: list[RankExit] = []
    planned: bool = False  # as RankExit.planned, for the headline rank
    error: str = ""  # as RankExit's, for the headline rank
    early: bool = False
    usage: bool = False
    unlinked: bool = False
    persisted: Persisted = ""
    persisted_at: tuple[int, int] | None = None
    orphaned: bool = False

    def is_fault(self) -> bool:
        """Whether this record's headline rank ended in a fault (events.job.failed): what the scheduler acts on."""
        return failed(self.exits()[0])

    def exits(self) -> list[RankExit]:
        """Every rank this record covers, its headline rank first."""
        first = RankExit(rank=self.rank, exit_code=self.exit_code, cause=self.cause, unrunnable=self.unrunnable,
                         planned=self.planned, error=self.error, early=self.early, usage=self.usage,
                         unlinked=self.unlinked, persisted=self.persisted, persisted_at=self.persisted_at,
                         orphaned=self.orphaned)
        return [first, *self.others]


def exits_record(exits: list[RankExit], *, job_id: str, node: str, attempt: int, event_id: str, occurred_at: float,
                 causation_id: str = "", producer: str = "") -> WorkersExited:
    """One node's exits as one record: the first failed one (in the order given) heads it, the rest by rank."""
    head = next((x for x in exits if failed(x)), exits[0])
    others = sorted((x for x in exits if x is not head), key=lambda x: x.rank)
    told = any(x.error or x.early or x.usage or x.unlinked for x in exits)
    said = any(x.persisted for x in exits)
    said_at = any(x.persisted_at is not None for x in exits)
    orphans = any(x.orphaned for x in exits)
    return WorkersExited(job_id=job_id, node=node, attempt=attempt, rank=head.rank, exit_code=head.exit_code,
                         cause=head.cause, unrunnable=head.unrunnable, planned=head.planned, others=others,
                         error=head.error, early=head.early, usage=head.usage, unlinked=head.unlinked,
                         persisted=head.persisted, persisted_at=head.persisted_at, orphaned=head.orphaned,
                         event_id=event_id, occurred_at=occurred_at, causation_id=causation_id, producer=producer,
                         schema_version=6 if orphans else 5 if said_at else 4 if said else 3 if told else 2 if others
                         else 1)


def failed(x: RankExit) -> bool:
    """Whether a rank's end is a fault: any exit but 0, and an exit 0 of a script that never called
    flightdeck.init() (it reported no step, so "every step ran" cannot be what its 0 says)."""
    return x.exit_code != 0 or x.unlinked


class JobResumed(JobEvent, frozen=True, kw_only=True):
    attempt: int
    from_step: int
    checkpoint_id: str = ""
    world_size: int


# A job's phase as the scheduler records it: "paused" is running with its ranks told to stop stepping (a person's
# pause, or the scheduler's asking the operator); the last three are ends.
JobPhase = Literal["queued", "placing", "running", "paused", "stopping", "preempted", "recovering",
                   "completed", "failed", "cancelled"]


class JobPhaseChanged(JobEvent, frozen=True, kw_only=True):
    """The scheduler's record of a job's phase, appended whenever its phase, the reason for it or the restarts it
    has spent change: the one place views read a job's phase from (they never re-infer it from the decisions)."""

    phase: JobPhase
    attempt: int  # the attempt this phase is about (the next one's, once a restart or a preemption is decided)
    restarts: int  # restarts of its budget the job has spent (a free restart, a preemption or a grow-back: none)
    # Why it is in this phase, in the scheduler's words with the error itself ("" while running, and once completed):
    # the fault a restart follows, the denial a queued job waits out, who preempted it, why it failed.
    reason: str = ""


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


class RollbackAsked(JobEvent, frozen=True, kw_only=True):
    """An operator asks for a running job to roll back to its newest checkpoint at or before `to_step`, skipping the
    batch window [skip_from, skip_to) after it (empty: none). The scheduler decides the RollbackRequested."""

    to_step: int
    skip_from: int = 0
    skip_to: int = 0
    reason: str = ""


class CheckpointAdopted(JobEvent, frozen=True, kw_only=True):
    """A new job starts from this (ended) job's checkpoint (its spec's `init_from`, as `flightdeck submit` resolved
    it): recorded in the history of the job whose checkpoint it is, beside the new job's own JobSubmitted."""

    by_job: str  # the new job
    checkpoint_id: str
    step: int
    what: str = "all"  # "all" (continued) or "model" (its weights only)


class JobCancelled(JobEvent, frozen=True, kw_only=True):
    reason: str = ""
