"""The job spec: what a user submits (TOML decoded straight into these structs) and what JobSubmitted carries."""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# safe in subjects, paths and object keys; \Z, not $, which would let a trailing newline through
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}\Z"
Name = Annotated[str, Meta(pattern=NAME_PATTERN)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]


class Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base: unknown keys in a spec are a user error, not something to ignore."""


class ModelSpec(Spec, frozen=True, kw_only=True):
    n_layer: Annotated[int, Meta(ge=1, le=256)] = 2
    n_head: Annotated[int, Meta(ge=1, le=256)] = 2
    d_model: Annotated[int, Meta(ge=8, le=65536)] = 64
    seq_len: Annotated[int, Meta(ge=8, le=131072)] = 64
    vocab_size: Annotated[int, Meta(ge=2, le=1_048_576)] = 256  # byte-level tokens by default


class TrainSpec(Spec, frozen=True, kw_only=True):
    steps: Annotated[int, Meta(ge=1, le=100_000_000)] = 100
    batch_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 8  # global batch, in sequences
    lr: Annotated[float, Meta(gt=0.0, le=10.0)] = 3e-3
    checkpoint_every: Annotated[int, Meta(ge=1, le=100_000_000)] = 25
    # Steps between host snapshots in the node's shared memory (0: none): a failure persists the newest, so it
    # costs at most this many steps, not up to checkpoint_every (events/snapshot.py).
    snapshot_every: Annotated[int, Meta(ge=0, le=100_000_000)] = 1
    # ... and at most this share of the training time spent on them (the copy's stall and the hashing): a rank
    # spaces its snapshots out further when one costs more than this of the steps since the last (1: never).
    snapshot_max_overhead: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.02
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    data: Literal["corpus", "synthetic"] = "corpus"


class ParallelSpec(Spec, frozen=True, kw_only=True):
    """The layout a script builds from `run.plan` when its ranks allow it: TP ranks within a node, PP pipeline
    stages, data parallelism over the rest. With fewer ranks (a shrink) the resharder plans the nearest smaller
    layout (events/plan.py, nearest_layouts). 1 x 1: the planner's own choice for the model and the slots."""

    tp: Annotated[int, Meta(ge=1, le=1024)] = 1
    pp: Annotated[int, Meta(ge=1, le=1024)] = 1


class PolicySpec(Spec, frozen=True, kw_only=True):
    max_restarts: Annotated[int, Meta(ge=0, le=1000)] = 3
    # no restart is spent where one cannot help: the trainer API refused the script's call, or an attempt failed
    # the same way before its first step as the attempt before it (the same error, or never calling init())
    fail_fast: bool = True
    min_slots: Annotated[int, Meta(ge=0, le=65536)] = 0  # smallest world size to shrink to; 0 means the job's slots
    heartbeat_interval_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 1.0
    heartbeat_misses: Annotated[int, Meta(ge=1, le=1000)] = 5
    hang_factor: Annotated[float, Meta(gt=1.0, le=1000.0)] = 10.0  # hang deadline = factor x recent step time
    hang_min_s: Annotated[float, Meta(gt=0.0, le=86_400.0)] = 30.0
    # least time a started rank may take to its first sign of life (imports, loading a model); a script that
    # never calls the trainer API is found silent after it, like a lost rank
    startup_grace_s: Annotated[float, Meta(gt=0.0, le=86_400.0)] = 120.0
    # A loss spike is evidence that adds up (services/health/spikes.py, SpikeWatch): each loss counts by how far
    # its robust z passes spike_drift, at most spike_z - spike_drift, and a spike is found once the count reaches
    # spike_steps such steps in full, so one noisy loss, however high, is never a spike on its own
    spike_z: Annotated[float, Meta(gt=0.0, le=1000.0)] = 4.0
    spike_drift: Annotated[float, Meta(ge=0.0, le=1000.0)] = 1.5
    spike_steps: Annotated[int, Meta(ge=1, le=10_000)] = 3
    spike_window: Annotated[int, Meta(ge=4, le=100_000)] = 50
    spike_warmup: Annotated[int, Meta(ge=0, le=100_000_000)] = 20
    straggler_factor: Annotated[float, Meta(gt=1.0, le=100.0)] = 2.0
    straggler_window: Annotated[int, Meta(ge=1, le=100_000)] = 20
    replace_stragglers: bool = False
    rollback_steps_back: Annotated[int, Meta(ge=0, le=100_000_000)] = 100
    # a spike rollback skips the batches that carried the spike (its finding's onset..step) and this many after them
    rollback_skip_batches: Annotated[int, Meta(ge=0, le=100_000_000)] = 0
    # the most of train.steps' batches spike rollbacks may skip in all: a rollback past it pauses the job and asks
    # the operator (its reason says how to roll back anyway or go on), never skipping that much data silently
    max_skip_fraction: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.02
    # a spike rollback first trains the spike's batches again from its checkpoint, to tell data, optimisation and
    # hardware apart (services/health/diagnosis.py); costs that window's steps once more, then the skip goes ahead
    spike_diagnosis: bool = False
    keep_checkpoints: Annotated[int, Meta(ge=1, le=100_000)] = 3  # committed checkpoints kept (plus rollback targets)
    # a restart waits at most this long for a checkpoint every rank has staged to commit (and never longer than
    # the work it holds took), rather than redo its steps from an older one; 0: never waits
    commit_wait_s: Annotated[float, Meta(ge=0.0, le=3600.0)] = 30.0
    # What follows when the store refuses the job's checkpoints (CheckpointsFailing): "continue" trains on with the
    # risk named in its phase (a crash then goes back to its newest saved step), "pause" pauses it and asks the
    # operator to fix the store and resume
    on_checkpoint_failures: Literal["continue", "pause"] = "continue"


MAX_FAULTS = 256  # drill faults in one spec
MAX_SPEC_BYTES = 1 << 20  # a spec is a few hundred bytes; a bigger file is a mistake or a bomb
MAX_RANK_BYTES = 1 << 40  # 1 TiB: no device or host a rank runs on holds more, so a spec needing more is an error

FaultKind = Literal["crash", "hang", "loss_spike", "nonfinite", "slow", "high_lr", "corrupt"]


class FaultSpec(Spec, frozen=True, kw_only=True):
    """A fault injected on purpose for a drill; recorded as such so a postmortem can tell it apart."""

    kind: FaultKind
    step: NonNegInt
    rank: NonNegInt = 0
    seconds: Annotated[float, Meta(ge=0.0, le=3600.0)] = 0.5  # per-step delay for "slow"
    factor: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0  # high_lr's LR multiplier, corrupt's noise; 0: the default
    # None: fire once, in the first attempt that reaches `step` (the node agent tells later attempts what fired);
    # a number pins the fault to that attempt.
    attempt: NonNegInt | None = None


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z"
NO_NUL_PATTERN = r"^[^\x00]*\Z"
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}\Z"  # a job id: one subject token
RESOLVED_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9_-]{0,127})?\Z"  # a checkpoint id, or "" before the client resolves it
CODE_PATTERN = r"^(sha256:[0-9a-f]{64})?\Z"  # a shipped archive's content address, or ""
EnvName = Annotated[str, Meta(pattern=ENV_NAME_PATTERN)]
Arg = Annotated[str, Meta(max_length=4096, pattern=NO_NUL_PATTERN)]  # execve cannot pass a NUL
# Set by the node agent for every rank: a job may not override how its ranks find each other or the platform.
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT")
RESERVED_ENV_PREFIX = "FLIGHTDECK_"


class EntrypointSpec(Spec, frozen=True, kw_only=True):
    """What each rank runs: the user's own training script, which reports through the trainer API
    (`import flightdeck`). "python" as the program is the node's Python (the one with torch and Flightdeck)."""

    command: Annotated[list[Arg], Meta(min_length=1, max_length=256)]
    # Where the ranks run. With `code`: a folder inside the shipped code ("": its top). Without: a path on the node
    # (relative to the agent's working directory; "": that directory), for code trees too large to ship.
    cwd: Annotated[str, Meta(max_length=4096, pattern=NO_NUL_PATTERN)] = ""
    env: Annotated[dict[EnvName, Arg], Meta(max_length=256)] = {}
    # The job's code as `flightdeck submit` shipped it (services/tools/codeship.py): the sha256 of its archive in
    # the object store, which every node agent fetches, checks and unpacks before it starts a rank; "": none.
    code: Annotated[str, Meta(pattern=CODE_PATTERN)] = ""
    code_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 0  # the archive's size
    # The job's own Python: an interpreter or a virtual environment's folder on every node ("": the node's, with
    # torch and Flightdeck), run as "python" in `command`.
    python: Annotated[str, Meta(max_length=4096, pattern=NO_NUL_PATTERN)] = ""
    # Packages beyond the node's (pip requirement specifiers; a path is read from the shipped code): installed once
    # per node into an environment made from that Python that still sees the node's packages (torch stays).
    requirements: Annotated[list[Arg], Meta(max_length=256)] = []


class InitFrom(Spec, frozen=True, kw_only=True):
    """Where a job's first attempt starts: a committed checkpoint of another job (`flightdeck submit
    --resume-from JOB`, or `[init_from]` in the spec). The client resolves it before the job is submitted: the
    checkpoint's id, step and manifest hash are recorded with the spec, so every node restores exactly that one."""

    job: Annotated[str, Meta(pattern=JOB_ID_PATTERN)]
    step: Annotated[int, Meta(ge=-1)] = -1  # its newest good checkpoint at or before this step; -1: its newest
    # "all": model, optimizer, data position and step (continue it); "model": the weights only, from step 0
    what: Literal["all", "model"] = "all"
    checkpoint_id: Annotated[str, Meta(pattern=RESOLVED_PATTERN)] = ""  # resolved by the client
    checkpoint_step: Annotated[int, Meta(ge=-1)] = -1
    manifest_sha256: Annotated[str, Meta(pattern=r"^([0-9a-f]{64})?\Z")] = ""


class JobSpec(Spec, frozen=True, kw_only=True):
    name: Name
    priority: Annotated[int, Meta(ge=0, le=1000)] = 50
    slots: Annotated[int, Meta(ge=1, le=65536)] = 1
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    parallel: ParallelSpec = ParallelSpec()
    policy: PolicySpec = PolicySpec()
    faults: Annotated[list[FaultSpec], Meta(max_length=MAX_FAULTS)] = []
    # None: the built-in trainer (`python -m flightdeck.trainer`), which reads [model]
    entrypoint: EntrypointSpec | None = None
    init_from: InitFrom | None = None  # None: the first attempt starts from scratch


class InvalidSpec(ValueError):
    """A job spec a user must fix; the message names the field and what is allowed."""


# What a pattern allows, as a person would say it (msgspec's message quotes the regex, its backslashes doubled).
PATTERN_WORDS = {
    NAME_PATTERN: "lowercase letters, digits and '-', starting with a letter or digit, at most 63 characters",
    ENV_NAME_PATTERN: "letters, digits and '_', not starting with a digit, at most 128 characters",
    NO_NUL_PATTERN: "text without a NUL character",
    JOB_ID_PATTERN: "a job id as `flightdeck submit` printed it (letters, digits, '-' and '_')",
    RESOLVED_PATTERN: "a checkpoint id (letters, digits, '-' and '_'), or empty",
    CODE_PATTERN: "'sha256:' and 64 lowercase hex digits (set by `flightdeck submit`), or empty",
}


def in_words(message: str) -> str:
    """A validation message with any regex it quotes said in words."""
    for pattern, words in PATTERN_WORDS.items():
        message = message.replace(f"`str` matching regex {pattern!r}", f"{words}")
    return message


def _params(spec: JobSpec) -> int:
    """trainer/model.py's GPT: token and position embeddings, the blocks, the final norm and the (untied) head."""
    m, d = spec.model, spec.model.d_model
    return 2 * m.vocab_size * d + m.seq_len * d + m.n_layer * (12 * d * d + 13 * d) + 2 * d


def snapshot_bytes(spec: JobSpec) -> int:
    """One rank's host snapshot of the built-in trainer's state (fp32 weights and AdamW's two moments, a full
    replica on every rank: at most, under TP or PP); 0 for a user's script, whose state only its first checkpoint
    tells."""
    if spec.entrypoint is not None or spec.train.snapshot_every == 0:
        return 0
    return 12 * _params(spec)


def rank_memory_bytes(spec: JobSpec) -> int:
    """A generous estimate of what one rank allocates (trainer/model.py's GPT, fp32 Adam, attention without
    a fused kernel, the global batch's token windows drawn on every rank), at the smallest world size the
    job may shrink to. Only to refuse specs that could never run, before any rank allocates anything."""
    m, d = spec.model, spec.model.d_model
    params = _params(spec)
    rows = -(-spec.train.batch_size // (spec.policy.min_slots or spec.slots))
    activations = rows * m.seq_len * (m.n_layer * (34 * d + 5 * m.n_head * m.seq_len) + 2 * m.vocab_size) * 4
    windows = spec.train.batch_size * (m.seq_len + 1) * 8
    return 16 * params + activations + windows


def check(spec: JobSpec) -> JobSpec:
    """The rules across fields (and the memory a rank would need); InvalidSpec names what to change."""
    for i, fault in enumerate(spec.faults):
        if fault.rank >= spec.slots:
            raise InvalidSpec(f"faults[{i}].rank ({fault.rank}) must be below slots ({spec.slots})")
        if fault.step >= spec.train.steps:
            raise InvalidSpec(f"faults[{i}].step ({fault.step}) must be below train.steps ({spec.train.steps})")
    if spec.policy.spike_drift >= spec.policy.spike_z:
        raise InvalidSpec(f"policy.spike_drift ({spec.policy.spike_drift}) must be below policy.spike_z "
                          f"({spec.policy.spike_z}): a loss counts toward a spike by how far its z passes the drift")
    if spec.policy.min_slots > spec.slots:
        raise InvalidSpec(f"policy.min_slots ({spec.policy.min_slots}) must not exceed slots ({spec.slots})")
    want = spec.parallel.tp * spec.parallel.pp
    if spec.slots % want:
        raise InvalidSpec(f"parallel.tp x parallel.pp ({spec.parallel.tp} x {spec.parallel.pp} = {want}) must divide "
                          f"slots ({spec.slots}): the ranks left over would form no whole model replica")
    if spec.entrypoint is not None:
        return _check_entrypoint(spec.entrypoint, spec)
    if spec.model.n_head % spec.parallel.tp:
        raise InvalidSpec(f"parallel.tp ({spec.parallel.tp}) must divide model.n_head ({spec.model.n_head}): each "
                          "TP rank holds whole attention heads")
    if spec.model.n_layer % spec.parallel.pp:
        raise InvalidSpec(f"parallel.pp ({spec.parallel.pp}) must divide model.n_layer ({spec.model.n_layer}): "
                          "pipeline stages hold equal numbers of layers")
    need = rank_memory_bytes(spec)
    if need > MAX_RANK_BYTES:
        raise InvalidSpec(
            f"model and train need about {need / 2**40:,.1f} TiB per rank (more than {MAX_RANK_BYTES >> 40} TiB): "
            "lower model.seq_len, model.d_model, model.n_layer, model.vocab_size or train.batch_size, or raise slots"
        )
    if spec.model.d_model % spec.model.n_head:
        raise InvalidSpec(
            f"model.d_model ({spec.model.d_model}) must be a multiple of model.n_head ({spec.model.n_head})"
        )
    if spec.train.batch_size < spec.slots:
        raise InvalidSpec(
            f"train.batch_size ({spec.train.batch_size}) must be at least slots ({spec.slots}): one sequence per rank"
        )
    return spec


def _check_entrypoint(entry: EntrypointSpec, spec: JobSpec) -> JobSpec:
    if not entry.command[0].strip():
        raise InvalidSpec("entrypoint.command[0] is empty: name the program to run, e.g. [\"python\", \"train.py\"]")
    if entry.code and (entry.cwd.startswith("/") or ".." in entry.cwd.split("/")):
        raise InvalidSpec(f"entrypoint.cwd ({entry.cwd!r}) must be a folder inside the shipped code: relative, "
                          "without '..' (or ship no code and name a path on the nodes)")
    for key in entry.env:
        if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX):
            raise InvalidSpec(f"entrypoint.env.{key} is set by the node agent for every rank and may not be "
                              f"overridden (reserved: {', '.join(RESERVED_ENV)} and {RESERVED_ENV_PREFIX}*)")
    return spec


def spec_builtins(spec: JobSpec) -> dict[str, Any]:
    """The spec as plain data TOML can hold: no None (an absent [entrypoint] is the built-in trainer, an absent
    fault `attempt` an unpinned fault)."""
    data: dict[str, Any] = msgspec.to_builtins(spec)
    data["faults"] = [{k: v for k, v in f.items() if v is not None} for f in data.get("faults", [])]
    return {k: v for k, v in data.items() if v is not None}


def spec_toml(spec: JobSpec) -> bytes:
    """The spec as TOML that `parse_spec` reads back to an equal spec (the node agent writes it for its ranks)."""
    return msgspec.toml.encode(spec_builtins(spec))


def parse_spec(text: str | bytes) -> JobSpec:
    """Decode a TOML job spec, refusing unknown keys, wrong types and out-of-range values."""
    if len(text) > MAX_SPEC_BYTES:
        raise InvalidSpec(f"job spec is {len(text):,} bytes, more than the {MAX_SPEC_BYTES:,} a spec may have")
    if isinstance(text, bytes):  # decoded here: msgspec's own message for bad bytes differs between releases
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidSpec(f"job spec is not UTF-8 text: {exc}") from None
    try:
        spec = msgspec.toml.decode(text, type=JobSpec)
    except msgspec.ValidationError as exc:
        raise InvalidSpec(f"invalid job spec: {in_words(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise InvalidSpec(f"job spec is not valid TOML: {exc}") from None
    except RecursionError:  # TOML parsers recurse per nested array or inline table
        raise InvalidSpec("job spec nests arrays or tables too deeply to be a job spec") from None
    return check(spec)
