"""What the checkpoint service's core knows: its settings, each job's sets in flight, commits and holds, and
what one input made due. Frozen values only."""

from typing import Literal

import msgspec

from flightdeck.events.base import JobEvent
from flightdeck.events.checkpoint import CheckpointFailed, CheckpointPending, CheckpointStaged, DataPosition, ShardInfo
from flightdeck.events.lineage import Fork

DEFAULT_KEEP = 3


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What the core decides with: recorded by the shell as CoreConfigured and folded from it."""

    scrub_every_s: float = 0.0  # re-verify each committed checkpoint in the store this often (0: never)
    scrub_mb_s: float = 64.0  # read back at most this fast (MB/s), beside the training's own traffic
    # "agents": commit once every rank's agent reported its shards stored (ShardsUploaded), reading them back from
    # the store. "staging": the protocol of histories recorded before agents stored shards (the service read the
    # ranks' staging folders), kept so that they still verify.
    shards_from: Literal["staging", "agents"] = "staging"
    # "yes": say CheckpointPending once a set has fully staged, so a restart can wait for its commit. "no" for
    # histories recorded before the event existed, so that they still verify.
    announce_pending: Literal["no", "yes"] = "no"
    # "yes": a set persisted from memory that lacks only ranks whose exits say their agent staged none (and ranks
    # on lost nodes) settles at once, as after a lost node. "no" for histories recorded before exits said so.
    settle_on_exits: Literal["no", "yes"] = "no"
    # "yes": a set persisted from memory, once handed over, supersedes its attempt's older ones (their commit could
    # end a restart's wait first: JobState.memory_handed); "parked": and an older one waits staged until the newer
    # one is handed over or fails (settle.py). "no"/"yes" for histories recorded before, so they still verify.
    supersede: Literal["no", "yes", "parked"] = "no"
    # Which `keep` are the newest: "steps" ranks them as a restart picks its checkpoint (lineage.newest: the
    # highest steps, ties in commit order), so sets committed out of order (their uploads finished so) never cost
    # a newer step or the restart's own target; "commits" (commit order) for histories recorded before.
    retention: Literal["commits", "steps"] = "commits"
    # "verify": a node's claim that a checkpoint is bad (CheckpointRejected, CheckpointRefused) has the service read
    # it back from the store first (Claim), and only that read's finding makes it bad; "trust": the claim alone
    # made it bad and deleted it (histories recorded before, so that they still verify).
    claims: Literal["trust", "verify"] = "trust"
    # A job's sets failing this many times in a row for the store's part (CheckpointFailed.store) is an incident
    # (CheckpointsFailing), and a completed job whose final state is not stored says so (FinalStateUnsaved); 0:
    # neither, as histories recorded before.
    failing_after: int = 0
    # "lost": a node declared lost is fenced from every attempt whose ranks it ran (JobState.fenced): what it
    # stages or stores for them later is refused, as a frozen agent that resumes ships what its replaced ranks
    # trained unseen (issue 51); "none" for histories recorded before, so that they still verify.
    fence: Literal["none", "lost"] = "none"
    # "amended": a final checkpoint that commits after FinalStateUnsaved was said (its set came late) is recorded as
    # FinalStateSaved; "kept" for histories recorded before, so that they still verify.
    final_late: Literal["kept", "amended"] = "kept"

    def __post_init__(self) -> None:
        if not (self.scrub_every_s >= 0 and self.scrub_mb_s > 0):
            raise ValueError(f"checkpoint service settings out of range: {self}")


class ScrubArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What the "scrub" effect needs: one committed checkpoint to read back, and how fast it may read."""

    job_id: str
    checkpoint_id: str
    step: int
    manifest_sha256: str
    bytes_per_s: float
    claim_node: str = ""  # the node whose claim asked for this read ("" for a scrub on schedule)
    claim_cause: str = ""


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """A node's claim that a committed checkpoint is bad, waiting for the service's own read of it."""

    job_id: str
    checkpoint_id: str
    node: str
    cause: str


class Scrub(msgspec.Struct, frozen=True, kw_only=True):
    """The scrub in flight (one at a time, for the whole store): expected back by `deadline`."""

    job_id: str
    checkpoint_id: str
    deadline: float


class StagedRank(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    node: str  # whose agent stored its shards
    shards: list[ShardInfo]  # as the rank announced them: what the store must hold


class CommitArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What the "commit" effect needs: every rank's shards of one (job, attempt, timeline, step), which their
    agents reported stored."""

    job_id: str
    checkpoint_id: str
    attempt: int
    step: int
    world_size: int
    timeline: int = 0
    created_at: float  # the completing staging's recorded time, so a re-run writes the same manifest
    data: DataPosition
    ranks: list[StagedRank]
    from_memory: bool = False  # the ranks' snapshots, persisted by their agents (events/snapshot.py)


class DeleteArgs(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    checkpoint_ids: list[str]


class Staging(msgspec.Struct, frozen=True, kw_only=True):
    world_size: int
    ranks: dict[int, CheckpointStaged]
    stored: frozenset[int] = frozenset()  # ranks whose agents reported their announced shards stored


class Committed(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    step: int
    world_size: int
    attempt: int = 0
    timeline: int = 0
    bytes: int = 0
    manifest_sha256: str = ""
    verified_at: float = 0.0  # when its stored bytes last matched their manifest (its commit, then scrubs)


class Hold(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint ranks are about to load: kept until `world_size` ranks report they have."""

    world_size: int
    attempt: int = -1  # a restart's attempt (its ranks report RankStarted); -1: an in-process rollback
    ranks: frozenset[int] = frozenset()


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    keep: int = DEFAULT_KEEP
    attempt: int = 0  # newest attempt whose ranks run; stagings from older ones are stale
    staging: dict[tuple[int, int, int], Staging] = {}  # (attempt, timeline, step) -> ranks staged so far
    handed: frozenset[tuple[int, int, int]] = frozenset()  # (attempt, timeline, step) given to the uploader
    committed: tuple[Committed, ...] = ()  # commit order; deleted ones leave when CheckpointDeleted returns
    doomed: frozenset[str] = frozenset()  # deletion decided
    holds: dict[str, Hold] = {}
    ended: bool = False
    completed: bool = False  # ended by JobCompleted: sets of its last attempt may still arrive
    every: int = 0  # the spec's checkpoint_every (0: not known)
    final: int = -1  # a completed job's last step while the set staged there is due, else -1
    ended_at: float = 0.0
    forks: tuple[Fork, ...] = ()  # the timelines rollbacks started
    bad: dict[str, str] = {}  # found bad (on restore, or by a scrub) -> why it is deleted: never one of the `keep`
    # claimed bad by a node and not read back yet (Settings.claims "verify"): kept, but not counted among the `keep`,
    # so that what a restore falls back to if the read confirms the claim is still there
    doubted: frozenset[str] = frozenset()
    placement: dict[int, dict[int, str]] = {}  # attempt -> rank -> node, as granted (this attempt's and newer)
    # attempt -> its ranks whose exit said their agent staged no snapshot (RankExit.persisted "none"): none comes
    staged_none: dict[int, frozenset[int]] = {}
    # attempt -> rank -> the newest (timeline, step) its exit says its agent staged (RankExit.persisted_at)
    staged_upto: dict[int, dict[int, tuple[int, int]]] = {}
    # attempt -> the newest (timeline, step) of a set persisted from memory handed over: the restart restores that
    # one, so its attempt's older sets from memory are superseded (one that committed first ended the restart's wait)
    memory_handed: dict[int, tuple[int, int]] = {}
    failures: int = 0  # its sets the store refused in a row since its newest commit
    failing_from: int = -1  # ... the first of them's step
    failing: bool = False  # CheckpointsFailing said so; CheckpointsRecovered will
    last_failed: int = -1  # the step of its newest set that failed (for whatever reason)
    committing: dict[str, int] = {}  # sets handed to the uploader whose commit or failure is not read back yet -> step
    last_step: int = -1  # a completed job's last step: its final state is the set of that step
    final_state: Literal["", "saved", "unsaved"] = ""  # what was recorded of it
    # attempt -> nodes declared lost while they ran its ranks (Settings.fence "lost"): their later writes are refused
    fenced: dict[int, frozenset[str]] = {}


class Due(msgspec.Struct, frozen=True, kw_only=True):
    """What one input made due: the transition turns it into outputs."""

    commit: CommitArgs | None = None
    doomed: tuple[str, ...] = ()
    failed: CheckpointFailed | None = None  # a set that can never commit (its shards could not be stored)
    failed_id: str = ""  # ... and its checkpoint id, whose stored objects are removed
    pending: CheckpointPending | None = None  # a set every rank has staged: its commit is on its way
    findings: tuple[JobEvent, ...] = ()  # the store's incidents, and a completed job's final state unsaved


NOTHING_DUE = Due()


class State(msgspec.Struct, frozen=True, kw_only=True):
    jobs: dict[str, JobState] = {}
    settings: Settings = Settings()
    scrub: Scrub | None = None
    claims: tuple[Claim, ...] = ()  # claims to read back, oldest first: each goes before any scheduled scrub
    lost: frozenset[str] = frozenset()  # nodes lost and not registered since
