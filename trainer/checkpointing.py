"""Two-phase checkpoints: a host snapshot at a step boundary (the only stall), then a background thread
that writes DCP shards (one file per rank) into <staging>/<job>/step-<N>/ (step-<N>-t<k> once k rollbacks
were applied: a redone step must not overwrite the set it replaces while that may still be uploading),
hashes what this rank wrote and announces CheckpointStaged. Restore loads such a directory at any world
size, verifying sha256s first when a manifest is given."""

import copy
import hashlib
import json
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from flightdeck.events.base import RankEvent
from flightdeck.events.checkpoint import CheckpointStaged, DataPosition, ShardInfo
from flightdeck.trainer import snapshots
from flightdeck.trainer.distributed import Dist
from flightdeck.trainer.hostcopy import HostCopier
from flightdeck.trainer.state import TrainState, keys

log = structlog.get_logger(__name__)
# DCP warns on every single-process save and load; one rank alone is a supported way to run here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
META_KEY = "flightdeck"  # JSON: step, data position, world size; a non-tensor DCP item


class CorruptCheckpoint(ValueError):
    """A checkpoint that cannot be trusted or read: missing, altered or truncated files."""


class CheckpointWriteError(RuntimeError):
    pass


class Manifest(msgspec.Struct, kw_only=True):
    """The part of a checkpoint manifest the trainer reads; other fields are the checkpoint service's."""

    shards: list[ShardInfo]


MANIFEST_NAMES = ("MANIFEST.json", "manifest.json")  # the checkpoint service writes the first


def manifest_in(path: Path) -> Path | None:
    return next((path / n for n in MANIFEST_NAMES if (path / n).exists()), None)


# services/shell/objects/manifest.py's cap (a trainer imports no service; a test holds the two equal): the
# checkpoint service writes no larger manifest, so a larger one is hostile and is not read into memory.
MAX_MANIFEST_BYTES = 16_843_008


def read_manifest(path: Path) -> list[ShardInfo]:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"checkpoint manifest {path} is larger than {MAX_MANIFEST_BYTES} bytes, more "
                                    "than any checkpoint needs; restore another checkpoint")
        return msgspec.json.decode(data, type=Manifest).shards
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptCheckpoint(f"cannot read checkpoint manifest {path}: {exc}") from None


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Checkpointer:
    """Saves this rank's part of a checkpoint; at most one background write at a time."""

    def __init__(self, *, job_id: str, staging: Path, dist: Dist, emit: Callable[[RankEvent], None],
                 envelope: dict[str, Any]) -> None:
        self.root = staging / job_id
        self.dist = dist
        self.emit = emit
        self.envelope = envelope  # job_id, rank, attempt, node for the events this rank emits
        self.buffers: dict[str, Any] = {}  # host copies of the live tensors (DTensors stay DTensors), by key
        self._layout: list[tuple[str, torch.Size, torch.dtype]] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_step: int | None = None
        self.timeline = 0  # rollbacks applied: what CheckpointStaged tells the checkpoint service
        self._copy_stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None  # the last snapshot's copies, until before_update
        self._copier: HostCopier | None = None  # CPU: the copy over a few threads, made on the first snapshot

    def prepare(self, live: dict[str, Any]) -> None:
        """Allocate the host buffers (again only when the state's layout changed); pinned on CUDA so
        device-to-host copies run at full speed."""
        tensors = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)}
        layout = [(k, t.shape, t.dtype) for k, t in tensors.items()]
        if layout == self._layout:
            return
        pin = self.dist.device.type == "cuda"
        self.buffers = _create_cpu_state_dict(tensors, pin_memory=pin)
        self._layout = layout
        if not pin:
            for buf in self.buffers.values():
                local = buf.to_local() if isinstance(buf, DTensor) else buf
                local.zero_()  # fault the pages in now, not during the first save's stall

    def snapshot(self, live: dict[str, Any]) -> dict[str, Any]:
        """Copy the live state into the host buffers (values that are not tensors are copied as they are).
        On CUDA the copies are only queued, on a side stream after the step's work: the host goes on at once,
        the copy overlaps the next forward/backward, and `before_update` keeps the next optimizer step (the
        first write to this state) behind it."""
        self.prepare(live)
        out: dict[str, Any] = {k: (v if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in live.items()}
        tensors = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)}
        if self.dist.device.type != "cuda":
            self._copier = self._copier or HostCopier()
            self._copier.copy(tensors, self.buffers)
        else:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.dist.device)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.dist.device))
            with torch.cuda.stream(self._copy_stream):
                _copy_state_dict(tensors, self.buffers, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        out.update(self.buffers)
        return out

    def before_update(self) -> None:
        """Call before changing the live state in place: a GPU-side wait for the snapshot copy, no host sync."""
        if self._copied is not None:
            torch.cuda.current_stream(self.dist.device).wait_event(self._copied)
            self._copied = None

    def snapshot_done(self) -> None:
        """Block until the last snapshot is in host memory (the writer does this before writing)."""
        if self._copied is not None:
            self._copied.synchronize()

    def save(self, step: int, live: dict[str, Any], position: DataPosition, layout: Sequence[int] = ()) -> float:
        """Snapshot now and write in the background; returns the stall (seconds the caller was blocked)."""
        started = time.perf_counter()
        self.wait()  # the buffers are reused: the previous write must be done with them
        state = self.snapshot(live)
        state[META_KEY] = meta_item(step, position, self.dist.world_size, layout)
        stall = time.perf_counter() - started
        path = self.staged_dir(step, self.timeline)
        copied = self._copied
        self._thread = threading.Thread(target=self._write,
                                        args=(step, self.timeline, path, state, position, stall, copied),
                                        name=f"ckpt-{step}", daemon=True)
        self._thread.start()
        self.last_step = step
        return stall

    def _write(self, step: int, timeline: int, path: Path, state: dict[str, object], position: DataPosition,
               stall: float, copied: torch.cuda.Event | None) -> None:
        started = time.perf_counter()
        try:
            if copied is not None:
                copied.synchronize()
            path.mkdir(parents=True, exist_ok=True)
            group = self.dist.ckpt_group
            writer = dcp.FileSystemWriter(path, overwrite=True)  # said, so DCP does not warn on every redone step
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
            # What this rank wrote (DCP names a rank's files __<rank>_<n>.distcp), and the metadata on rank 0.
            names = sorted(f.name for f in path.glob(f"__{self.dist.rank}_*.distcp"))
            if self.dist.rank == 0:
                names.append(".metadata")
            shards = [ShardInfo(path=n, size=(path / n).stat().st_size, sha256=sha256_file(path / n)) for n in names]
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc
            return
        write_s = time.perf_counter() - started
        self.emit(CheckpointStaged(step=step, world_size=self.dist.world_size, staging_dir=str(path.resolve()),
                                   shards=shards, data=position, stall_s=stall, write_s=write_s,
                                   timeline=timeline, **self.envelope))
        log.info("checkpoint staged", step=step, path=str(path), stall_s=round(stall, 4), write_s=round(write_s, 3))

    def staged_dir(self, step: int, timeline: int) -> Path:
        return self.root / (f"step-{step}-t{timeline}" if timeline else f"step-{step}")

    def staged_dirs(self, step: int) -> list[Path]:
        """Where this node may have staged `step`, the current timeline's set first: of the sets of one step,
        that is the one on the current lineage."""
        return [self.staged_dir(step, t) for t in range(self.timeline, -1, -1)]

    def rolled_back(self) -> int:
        """Count a rollback just applied (call after `wait`): later sets belong to a new timeline. Returns it."""
        self.timeline += 1
        return self.timeline

    @property
    def writing(self) -> bool:
        """A background write is under way."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the background write is done; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteError(f"writing checkpoint step {self.last_step} failed: {error!r}") from error


def _cause(exc: BaseException) -> str:
    """What went wrong in a load: for DCP's wrapper, the first rank's own exception, not its traceback dump."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return f"{type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def meta_item(step: int, position: DataPosition, world_size: int, layout: Sequence[int] = ()) -> str:
    """The checkpoint's own record of where it stands (META_KEY): with the DP x TP x PP it was saved in, when known."""
    return json.dumps({"step": step, "next_batch": position.next_batch, "skipped": position.skipped,
                       "world_size": world_size, **({"layout": list(layout)} if layout else {})})


def has_dtensors(state: dict[str, Any]) -> bool:
    return any(isinstance(v, DTensor) for v in state.values())


def verify(path: Path, shards: list[ShardInfo]) -> None:
    """Every listed file exists with the listed size and sha256, or CorruptCheckpoint says which does not."""
    for shard in shards:
        if shard.path.startswith("/") or ".." in Path(shard.path).parts:
            raise CorruptCheckpoint(f"manifest path {shard.path!r} escapes the checkpoint directory {path}")
        f = path / shard.path
        if not f.is_file():
            raise CorruptCheckpoint(f"checkpoint {path} is missing {shard.path}; restore another checkpoint")
        size = f.stat().st_size
        if size != shard.size:
            raise CorruptCheckpoint(f"checkpoint {path}: {shard.path} has {size} bytes, the manifest says "
                                    f"{shard.size}; the file is damaged, restore another checkpoint")
        digest = sha256_file(f)
        if digest != shard.sha256:
            raise CorruptCheckpoint(f"checkpoint {path}: {shard.path} has sha256 {digest}, the manifest says "
                                    f"{shard.sha256}; the file is damaged, restore another checkpoint")


def load(path: Path, state: TrainState, dist: Dist, shards: list[ShardInfo] | None = None, *,
         model_only: bool = False) -> tuple[int, DataPosition]:
    """Load a checkpoint into the registered state (any saved world size); returns its step and data position.
    `model_only`: the model's weights alone (the optimizer, RNG and extras stay as they are)."""
    if shards is not None:
        verify(path, shards)
    reader: dcp.StorageReader
    try:
        if snapshots.is_snapshot(path):  # persisted from a rank's memory, or that memory itself
            reader = snapshots.SnapshotReader(path)
        else:
            reader = dcp.FileSystemReader(path)
        saved = reader.read_metadata().state_dict_metadata
    except Exception as exc:
        raise CorruptCheckpoint(f"checkpoint {path} has no readable .metadata or snapshot header (incomplete or "
                                f"not a checkpoint): {exc}") from None
    if META_KEY not in saved:
        raise CorruptCheckpoint(f"checkpoint {path} was not written by Flightdeck's trainer API (no {META_KEY!r} item)")
    dest = state.load_target(saved, model_only=model_only)
    missing = sorted(keys(dest) - set(saved))
    if missing:
        raise CorruptCheckpoint(f"checkpoint {path} does not fit the registered state: it lacks {missing[:3]} "
                                f"({len(missing)} items); was it saved from another model or optimizer?")
    dest[META_KEY] = ""
    try:
        dcp.load(dest, storage_reader=reader, process_group=dist.ckpt_group, no_dist=dist.ckpt_group is None)
    except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException: caught by name
        raise CorruptCheckpoint(f"cannot load checkpoint {path}: {_cause(exc)}") from exc
    meta = json.loads(str(dest.pop(META_KEY)))
    state.loaded_meta = meta
    try:
        state.apply(dest, model_only=model_only)
    except Exception as exc:
        raise CorruptCheckpoint(f"checkpoint {path} does not fit the registered state: {type(exc).__name__}: "
                                f"{exc}") from exc
    return int(meta["step"]), DataPosition(next_batch=meta["next_batch"], skipped=[tuple(w) for w in meta["skipped"]])
