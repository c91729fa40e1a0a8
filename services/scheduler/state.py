"""What the scheduler knows: jobs in flight, the queue, and its view of the fleet. Frozen values only."""

from typing import Literal

import msgspec

from flightdeck.events import lineage
from flightdeck.events.checkpoint import DataPosition
from flightdeck.events.job import JobPhase, SlotRef
from flightdeck.events.spec import JobSpec

Phase = Literal["queued", "placing", "running", "stopping", "preempted", "recovering",
                "completed", "failed", "cancelled"]
StopKind = Literal["", "preempt", "cancel", "grow"]
WAITING: frozenset[str] = frozenset({"queued", "preempted", "recovering"})  # phases a queued job can be in


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    step: int
    at: float  # when it was committed (its event's occurred_at)
    # When every rank had staged it (its CheckpointPending; 0: not seen). Its steps were trained by then: a commit
    # can land well after, when uploads are slower than the steps between two checkpoints.
    staged_at: float = 0.0
    data: DataPosition | None = None  # where its token stream stood (None: not known, read as step, no skips)
    attempt: int = 0  # the attempt that staged it
    timeline: int = 0  # rollbacks that attempt had applied then (events/lineage.py)
    rank_bytes: int = 0  # the most one rank staged: its host snapshot's size (0: not recorded)
    manifest_sha256: str = ""  # what a restore of it verifies its manifest against
    from_memory: bool = False  # persisted from the ranks' snapshots


class Pending(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint of the current attempt that every rank has staged (CheckpointPending): its commit is on its way."""

    checkpoint_id: str
    step: int
    at: float  # when it was announced
    nodes: tuple[str, ...]  # whose agents store its shards


class Rollback(msgspec.Struct, frozen=True, kw_only=True):
    """A RollbackRequested decided for the job's current attempt; in flight until a rank reports RolledBack."""

    attempt: int
    checkpoint_id: str
    to_step: int
    skip_from: int
    skip_to: int
    at: float  # when it was decided
    landed: bool = False  # a rank of the attempt reported RolledBack for it
    asked: str = ""  # an operator's (RollbackAsked): its event id; "" for a loss incident's


class Incident(msgspec.Struct, frozen=True, kw_only=True):
    """Loss spikes (or non-finite losses) around one spot of the run and the rollbacks they caused.

    `first..last` is the span of steps a later spike must fall in to count as the same incident."""

    first: int  # the first rollback's checkpoint step
    last: int  # the newest spike's step plus a margin
    skip_from: int  # the batch window the newest rollback skips
    skip_to: int
    steps: tuple[int, ...]  # the spikes' steps, oldest first
    triggers: tuple[str, ...]  # the findings' event ids, oldest first


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of a job, from its request to its release: a restart or a preemption starts the next one afresh
    (`Attempt(number=n + 1)`), so nothing of the last one's is carried over or cleared by hand."""

    number: int = 0  # stale events carry older ones
    requested: bool = False  # AllocationRequested for it awaits its answer
    asked_epoch: int = 0  # capacity epoch when the pending allocation was asked for
    use_spares: bool = False  # its placement replaces failed slots, so spares may be used
    ask_reason: str = ""  # why its AllocationRequested is made, when that is not plain admission
    restore: Checkpoint | None = None  # what it restores from, fixed when asked for (Settings.restores)
    world: int = 0  # slots asked for (or held): fewer than spec.slots when shrunk; 0 means spec.slots
    assignments: tuple[SlotRef, ...] = ()  # its granted slots
    started: frozenset[int] = frozenset()  # ranks whose workers started
    exited: frozenset[int] = frozenset()  # ranks that are gone (exited, lost, on a lost node)
    running_since: float = 0.0
    stop: StopKind = ""  # a stop in flight, and why
    stop_reason: str = ""
    stop_since: float = 0.0
    paused: str = ""  # why its ranks were told to stop stepping (a PauseRequested not resumed since); "" if not
    rollback: Rollback | None = None  # its newest rollback
    skips: tuple[tuple[int, int], ...] = ()  # batch windows its restore and its rollbacks added to its token stream
    bad_restore: str = ""  # why its checkpoint was rejected (CheckpointRejected): its restart is free
    claimed: str = ""  # ... and that checkpoint, which its restart has read back before it decides (claims.py)
    pending: Pending | None = None  # its newest fully staged checkpoint not yet committed or failed


ATTEMPT_FIELDS = frozenset(Attempt.__struct_fields__)


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """A job's whole life in the scheduler: what outlives its attempts here, the current one in `run`."""

    job_id: str
    spec: JobSpec
    order: int  # submission order: FIFO within a priority, kept when the job comes back to the queue
    run: Attempt = Attempt()  # the attempt the next (or current) allocation is for
    phase: Phase = "queued"
    why: str = ""  # why it is in `phase`, for the record (JobPhaseChanged.reason); "" while running
    restarts: int = 0  # restarts after faults; preemptions do not count
    denied_epoch: int = -1  # capacity epoch a denial answered: retry only once capacity has changed since
    denied_world: int = 0  # the world size the denial at `denied_epoch` answered
    preempted_by: str = ""
    checkpoints: tuple[Checkpoint, ...] = ()  # committed, oldest first
    faults: tuple[str, ...] = ()  # event ids of every fault, first to last: JobFailed's causes
    incident: Incident | None = None  # the latest loss incident; outlives restarts (it is about the data)
    asked_for: str = ""  # the loss finding whose rollback was left to the operator (the job paused)
    abandoned: frozenset[str] = frozenset()  # checkpoints of steps a rollback threw away: never a rollback target
    forks: tuple[lineage.Fork, ...] = ()  # timelines rollbacks started, every attempt's: never restored across
    staged: tuple[tuple[str, float], ...] = ()  # every fully staged checkpoint (id, when announced): staged_at
    waits_for: str = ""  # a queued restart waits for this checkpoint's commit (commit_wait.py) ...
    wait_until: float = 0.0  # ... until then at most
    # The attempt whose set persisted from memory has not come yet (commit_wait.MEMORY), and what it would save:
    # a later restart (a lost node found after the first one) may still wait for it.
    memory_from: int = -1
    memory_redo_s: float = 0.0
    # Ranks of that attempt with no recorded end when it failed: until each has one, the wait may last the lost
    # deadline; once none is owed, it lasts no longer than `memory_until` (what the training it saves took).
    memory_owed: frozenset[int] = frozenset()
    memory_until: float = 0.0
    memory_where: tuple[SlotRef, ...] = ()  # where the owed ranks ran: a node found lost owes none of its ranks' exits
    memory_staged: bool = False  # a rank's exit said its snapshot was staged: the set settles (checkpoint service)
    # How the attempt before `run` failed before its first step (policy.early_way; "": it did not): the same
    # again fails the job rather than spend another restart on it (policy.fail_fast)
    early_failure: str = ""
    # Its checkpoints are failing (CheckpointsFailing, until CheckpointsRecovered): the risk, shown as the reason of
    # its running phase (policy.on_checkpoint_failures "continue")
    at_risk: str = ""

    @property
    def attempt(self) -> int:
        return self.run.number

    @property
    def shown(self) -> tuple[JobPhase, str]:
        """The phase and its reason as recorded for the views: a running job whose ranks are paused is "paused"."""
        if self.phase == "running" and self.run.paused and not self.run.stop:
            return "paused", self.run.paused
        if self.phase == "running" and self.at_risk and not self.run.stop:
            return "running", self.at_risk
        return self.phase, self.why

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(ref.rank for ref in self.run.assignments)

    @property
    def size(self) -> int:
        """The world size of the attempt: the ranks it asks for or holds."""
        return self.run.world or self.spec.slots

    @property
    def newest(self) -> Checkpoint | None:
        """What a restart restores: lineage.newest."""
        return lineage.newest(self.checkpoints, self.forks)

    def skips_of(self, restore: Checkpoint | None) -> tuple[tuple[int, int], ...]:
        """The batch windows a restore of `restore` skips beyond its checkpoint's data position."""
        return lineage.restore_skips(self.forks, restore.attempt, restore.timeline, restore.step) if restore else ()


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    slots: int = 0
    spare: bool = False
    cordoned: bool = False
    lost: bool = False

    def usable(self, spares: bool) -> bool:
        return not self.cordoned and not self.lost and (spares or not self.spare)


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What the core decides with: recorded by the shell as CoreConfigured and folded from it."""

    stop_timeout_s: float = 120.0  # a stop (preemption, cancel) that outlasts this releases the slots anyway
    landing_timeout_s: float = 120.0  # a rollback no rank reports RolledBack for counts as in flight this long
    # "yes": a restart after a fault waits for the set persisted from the ranks' snapshots (commit_wait.MEMORY);
    # "settled": and at least the lost deadline while ranks of the failed attempt have no recorded end.
    # "known": and no longer once none can come: every rank's exit says it staged none, or its node was lost.
    # "promised": and once an exit says its rank's snapshot is staged, for that set up to policy.commit_wait_s, not
    # only as long as the training it saves took (on 6ade4e9 a loaded box committed it 0.07 s after that ran out).
    # Histories recorded before agents persisted snapshots replay with "no": nothing of the kind ever came.
    memory_wait: str = "no"
    # "yes": each change of a job's phase is recorded (JobPhaseChanged); histories from before replay with "no".
    phases: str = "no"
    # "requested": what an attempt restores is chosen when its slots are asked for, and recorded in the request
    # (the agents start its ranks from it); "granted": chosen when they are granted, recorded only as JobResumed
    # (histories from before, when the agents chose by the same rule from the same stream).
    restores: str = "granted"
    # "verify": a node's claim that the restore point is bad waits for the checkpoint service's own read of it
    # (claims.py); "trust": the claim alone took it out of the catalog (histories recorded before).
    claims: str = "trust"
    # "free": a restart a node's agent caused costs the budget nothing: a node lost before it started any of the
    # attempt's ranks granted to it (the job ran nothing there), or ranks that died with their agent (recorded as
    # `orphaned` by the next agent there); "charged" as histories recorded before.
    agent_faults: str = "charged"

    def __post_init__(self) -> None:
        if not (self.stop_timeout_s > 0 and self.landing_timeout_s > 0):
            raise ValueError(f"scheduler settings must be positive: {self}")


class State(msgspec.Struct, frozen=True, kw_only=True):
    settings: Settings = Settings()
    jobs: dict[str, Job] = {}  # jobs that have not ended
    ended: dict[str, Phase] = {}  # job id -> how it ended; later events about it change nothing
    queue: tuple[str, ...] = ()  # waiting jobs, best first: priority descending, then submission order
    nodes: dict[str, NodeView] = {}
    next_order: int = 0
    epoch: int = 0  # grows whenever capacity may have grown (a node joins or returns, slots are released)
    now: float = 0.0  # the latest time seen in an input
