"""Checkpoints: staged by ranks, committed (or failed) by the checkpoint service."""

import msgspec

from flightdeck.events.base import JobEvent, RankEvent


class ShardInfo(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # relative to the checkpoint's prefix; never absolute, never with ".."
    size: int
    sha256: str


class DataPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where the token stream stands: the next batch index and the windows skipped so far."""

    next_batch: int
    skipped: list[tuple[int, int]] = []


def batch_at(index: int, skipped: list[tuple[int, int]]) -> int:
    """The batch a step reads when its cursor stands at `index`: past every skipped window that holds it."""
    moved = True
    while moved:
        moved = False
        for a, b in skipped:
            if a <= index < b:
                index, moved = b, True
    return index


class CheckpointStaged(RankEvent, frozen=True, kw_only=True):
    step: int
    world_size: int
    staging_dir: str
    shards: list[ShardInfo]
    data: DataPosition
    stall_s: float  # time the step loop was blocked for the host snapshot
    write_s: float
    # Rollbacks the rank's attempt had applied: a step redone after a rollback is a different checkpoint.
    timeline: int = 0
    # Staged by the rank's node agent from the rank's snapshot in the node's memory (events/snapshot.py), after
    # the rank was gone: the set's shards are r<rank>.bin and r<rank>.json.
    from_memory: bool = False
    replicated: bool = False  # ... and its state is a full replica (plain data parallel): any rank's restores all


class ShardsUploaded(RankEvent, frozen=True, kw_only=True):
    """A node agent put its ranks' staged shards of one set into the object store (the ranks staged them on the
    node's own disk: CheckpointStaged), checking each file's size and sha256 against what its rank announced.
    One per node per set; `rank` is the lowest of `ranks`. `failed` "" means all of them are stored; else it
    says which shard could not be stored and why, and the set is never committed. The checkpoint service
    commits once every rank's shards are reported stored, after reading them back from the store."""

    step: int
    timeline: int = 0
    world_size: int
    ranks: list[int]  # the node's ranks this report covers
    bytes: int  # stored
    seconds: float  # from the first rank's announcement seen to the last shard stored
    failed: str = ""


def checkpoint_id(attempt: int, step: int, timeline: int = 0) -> str:
    """A checkpoint's name, unique per job (the same step may be checkpointed again by a later attempt, or by the
    same one after a rollback), that sorts by step. Its objects live under <job>/<checkpoint_id>/."""
    return f"step{step:09d}-a{attempt}" + (f"-t{timeline}" if timeline else "")


class CheckpointCommitted(JobEvent, frozen=True, kw_only=True):
    checkpoint_id: str
    step: int
    world_size: int
    uri: str  # manifest location in the object store
    bytes: int
    data: DataPosition
    manifest_sha256: str = ""  # sha256 of MANIFEST.json as written; a restore refuses any other manifest
    attempt: int = 0  # the attempt whose ranks staged it
    timeline: int = 0  # rollbacks that attempt had applied when it staged (events/lineage.py)
    from_memory: bool = False  # persisted by the agents from their ranks' snapshots after a failure
    rank_bytes: int = 0  # the most one rank staged: what a rank's host snapshot of this state holds (0: unknown)


class CheckpointPending(JobEvent, frozen=True, kw_only=True):
    """Every rank of a set has staged its shards: only storing them and verifying the store remain before its
    commit. A restart decided meanwhile may wait for that commit rather than redo the steps it holds."""

    checkpoint_id: str
    attempt: int
    step: int
    timeline: int = 0
    world_size: int
    nodes: list[str]  # whose agents store its shards: a lost one may never store them


class CheckpointFailed(JobEvent, frozen=True, kw_only=True):
    SCHEMA = 3  # 2 added `store`, 3 `node`; each is written as the oldest version that holds what it says

    step: int
    reason: str
    checkpoint_id: str = ""  # "" in histories recorded before it was given
    # The store refused it (a node could not store its shards, or the commit's writes or read-back failed), as
    # opposed to a set that can never be whole: these count toward CheckpointsFailing.
    store: bool = False
    # The node whose report the store contradicts: a shard its agent reported stored is missing from the store, or
    # differs there, read back by the checkpoint service. The node is the suspect, not the store (issue 51).
    node: str = ""


class CheckpointsFailing(JobEvent, frozen=True, kw_only=True):
    """The checkpoint service's finding that the object store refuses a job's checkpoints: `failures` sets in a row
    have failed since its newest commit (a full or read-only store, lost credentials). An incident until
    CheckpointsRecovered: status, the dashboard, /metrics and alerts show it, and the scheduler applies the job's
    policy.on_checkpoint_failures (pause and ask, or train on with the risk named)."""

    failures: int
    first_step: int  # the first failed set's step
    step: int  # the newest failed set's step
    newest_step: int  # the newest committed checkpoint's step: what a restore now goes back to (-1: none)
    reason: str  # the newest failure's, in the store's words


class CheckpointsRecovered(JobEvent, frozen=True, kw_only=True):
    """A set committed after CheckpointsFailing: the store takes the job's checkpoints again."""

    step: int
    failures: int  # how many had failed in a row before it


class FinalStateUnsaved(JobEvent, frozen=True, kw_only=True):
    """A completed job whose final state is not in the store: its final checkpoint failed or did not commit in time,
    or its checkpoints were failing when it ended. A job never ends "completed" silently without it: status shows
    this beside the completion."""

    step: int  # the job's last step
    newest_step: int  # its newest committed checkpoint's step (-1: none)
    reason: str


class FinalStateSaved(JobEvent, frozen=True, kw_only=True):
    """A completed job said FinalStateUnsaved whose final checkpoint committed after all (its set came late): that
    finding no longer holds, and views show the final state saved."""

    step: int  # the job's last step
    checkpoint_id: str  # the set that saved it


class CheckpointRejected(JobEvent, frozen=True, kw_only=True):
    """A node's agent found a committed checkpoint bad when a restart was to restore it (a shard's size or sha256
    differs from its manifest, a file or the manifest is missing): never loaded. One node's claim: the checkpoint
    service reads the store itself (CheckpointScrubbed with `claim_node`), and only that read makes it bad."""

    checkpoint_id: str
    step: int
    attempt: int  # the attempt that was to restore it
    node: str  # whose agent found it
    cause: str  # which file, and what was expected and found


class CheckpointRefused(RankEvent, frozen=True, kw_only=True):
    """A rank told to roll back found the target bad on its node (a shard's size or sha256 differs from the
    manifest, a file or the manifest is missing, the node could not download it) and loaded nothing: every rank
    trains on, and the scheduler rolls back to the newest good checkpoint instead. The ranks' counterpart of
    CheckpointRejected (ranks publish telemetry only)."""

    checkpoint_id: str
    to_step: int
    cause: str  # which file, and what was expected and found


class CheckpointScrubbed(JobEvent, frozen=True, kw_only=True):
    """The checkpoint service read a committed checkpoint back from the store (its manifest's sha256, every
    shard's size and sha256), at a bounded rate. `cause` "" means all matched; else it says which file differs
    and how, and the checkpoint is bad: never restored, deleted, not counted among the ones kept.

    A read asked by a node's claim (CheckpointRejected, CheckpointRefused) names that node in `claim_node`: one
    node's failed read is no verdict on the checkpoint (the node may see another store, or none), so this read by
    a second witness is. Found intact, the claiming node is the suspect (the resource manager cordons it)."""

    SCHEMA = 2  # 2 added `claim_node` and `claim_cause`; a scheduled scrub's read is still written as version 1

    checkpoint_id: str
    step: int
    bytes: int  # read back
    seconds: float
    cause: str = ""
    claim_node: str = ""  # the node whose claim asked for this read ("" for a scrub on the service's own schedule)
    claim_cause: str = ""  # ... and what that node said it found


class CheckpointDeleted(JobEvent, frozen=True, kw_only=True):
    checkpoint_id: str
    reason: str = "retention"
