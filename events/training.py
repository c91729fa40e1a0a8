"""Training telemetry published by trainer ranks: steps, heartbeats, faults and what ranks did."""

from typing import Literal

from flightdeck.events.base import RankEvent


class StepCompleted(RankEvent, frozen=True, kw_only=True):
    # 2 added `metrics`, 3 let `grad_norm` be None; a step with neither is still written as version 1
    SCHEMA = 3

    step: int
    loss: float  # NaN and Inf survive msgpack; JSON would turn them into null; the detectors read this one
    # None: not reported (0 in records of version 1 and 2); non-finite is a fault like a non-finite loss
    grad_norm: float | None
    lr: float  # NaN: not reported (0 in records written before 2026-11-29)
    tokens_per_s: float  # NaN: tokens not reported (0 in records written before 2026-11-29)
    step_time_s: float
    metrics: dict[str, float] = {}  # the script's own, by name (trainer API `report(step, loss, **metrics)`)


class Heartbeat(RankEvent, frozen=True, kw_only=True):
    step: int  # last completed step: heartbeats with a frozen step are how a hang shows
    interval_s: float


class RankFault(RankEvent, frozen=True, kw_only=True):
    SCHEMA = 2  # 2 added `usage`; a fault without it is still written as version 1

    kind: Literal["exception", "nonfinite", "cuda", "signal"]
    error_type: str
    message: str
    step: int
    # The trainer API refused how the script called it (a wrong type, a call out of order): the same code fails the
    # same way on any restart, so none is spent on it.
    usage: bool = False


class FaultInjected(RankEvent, frozen=True, kw_only=True):
    """A drill's fault, recorded by the rank before it acts, so a postmortem can tell a drill from a real fault."""

    SCHEMA = 2  # 2 added `fault`

    kind: Literal["crash", "hang", "loss_spike", "nonfinite", "slow"]
    step: int
    fault: int = -1  # its index in the spec's `faults`: a later attempt skips the unpinned ones that fired (-1: v1)


class RolledBack(RankEvent, frozen=True, kw_only=True):
    checkpoint_id: str
    to_step: int
    skip_from: int
    skip_to: int
    timeline: int = 0  # rollbacks this rank's attempt has applied, this one included


class SpikeReplayed(RankEvent, frozen=True, kw_only=True):
    """A diagnostic re-run before a rollback's skip: from `to_step` (the checkpoint's) the same batches were trained
    again, and these are this rank's losses for steps from_step.. (oldest first); then the checkpoint was restored
    again. NaN where a step reported none."""

    checkpoint_id: str
    from_step: int
    losses: list[float]
    seconds: float  # what the re-run cost, restore to restore


class RankStarted(RankEvent, frozen=True, kw_only=True):
    SCHEMA = 2  # 2 added `exactness`; a rank restored exactly (or from nothing) is still written as version 1

    world_size: int
    from_step: int
    device: str
    # Where it restored from: "store" (a committed checkpoint's copy), "memory" (its node's snapshot of that
    # checkpoint, events/snapshot.py), "" (nothing: step 0), or "local" (no platform: the newest staged set).
    restored_from: str = ""
    # Why the steps from here may part from the uninterrupted run's, bitwise (another layout, extras from another
    # rank's copy: trainer/exactness.py); "": they do not.
    exactness: str = ""


class SnapshotsOff(RankEvent, frozen=True, kw_only=True):
    """The rank takes no more host snapshots in its node's memory (train.snapshot_every): why. A failure then
    restores the newest committed checkpoint, as before snapshots."""

    step: int
    reason: str


class ModelRegistered(RankEvent, frozen=True, kw_only=True):
    """What rank 0 saw of the script's model at `register` and its first training step, for the planner
    (services/resharder): the parameter count, the transformer shape where the model says it, and the batch the
    script feeds. 0 is "not found"; `source` says where the shape came from."""

    params: int  # every parameter once, a sharded one (FSDP2's DTensor) at its full size
    trainable: int
    param_bytes: int
    layers: int = 0
    heads: int = 0
    hidden: int = 0
    vocab: int = 0
    seq_len: int = 0
    # The first training step's: sequences in one forward on this rank, and forwards per optimizer step.
    micro_batch: int = 0
    grad_accum: int = 0
    world_size: int = 1
    source: Literal["config", "modules", ""] = ""  # model.config (Hugging Face style), the module tree, none
    # data-parallel replicas, each fed its own batch (a TP group or a pipeline reads one together); 0: world_size
    dp: int = 0
