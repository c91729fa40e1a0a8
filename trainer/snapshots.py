"""A rank's host snapshots in shared memory that outlive it (the format: events/snapshot.py).

`Snapshots.take` copies the live state into the older of two slots at a step boundary (the stall: a memcpy over a
few threads, as for a checkpoint), then a worker thread has each item's checksum summed (in a helper process, off
this process's GIL: trainer/digester.py) and writes the header that makes the slot complete. A rank killed at any
point leaves its newest complete snapshot for its node agent to persist (services/agent/snapshots.py) and for its
next attempt to restore from memory.

`SnapshotReader` is a torch.distributed.checkpoint StorageReader over such slots (a folder of `r<rank>.json` and
`r<rank>.bin`): DCP plans the load, so a snapshot restores into any layout a DCP checkpoint would (FSDP2
shards resharded, a replicated model read from whichever rank holds it)."""

import contextlib
import copy
import io
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_dtensor
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from flightdeck.events import snapshot as fmt
from flightdeck.events.checkpoint import DataPosition
from flightdeck.trainer.digester import Digester
from flightdeck.trainer.hostcopy import HostCopier

log = structlog.get_logger("trainer")
ALIGN = 64


class SnapshotsOff(Exception):
    """Why this rank takes no snapshots (the node is short of shared memory, no root was given)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _same(a: Any, b: Any) -> bool:
    """Plain values equal, of one type (a container of tensors is never taken as equal)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # tensors inside: ambiguous, so packed again
        return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise fmt.BadSnapshot(f"snapshot names an unknown dtype {name!r}")
    return dtype


_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})


def _kept(value: Any) -> Any:
    """`value` as it is now, for the worker to pack later: an atom or a list of atoms (a group's parameter names)
    copied by hand, anything else deep-copied (copy.deepcopy of a list of names was most of the stall's Python)."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if (kind is list or kind is tuple) and all(type(v) in _ATOMS for v in value):
        return list(value) if kind is list else value
    return copy.deepcopy(value)


class _Layout(msgspec.Struct, frozen=True):
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


class _Slot:
    """One slot's .bin, mapped, with a tensor view per item."""

    def __init__(self, folder: Path, rank: int, layout: _Layout, offsets: list[int], size: int) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.header = folder / fmt.header_name(rank)
        self.header.unlink(missing_ok=True)
        path = folder / fmt.bin_name(rank)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            self.map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        self.views: dict[str, torch.Tensor] = {}
        for key, shape, dtype_name, at in zip(layout.keys, layout.shapes, layout.dtypes, offsets, strict=True):
            dtype = _dtype(dtype_name)
            count = 1
            for n in shape:
                count *= n
            flat = torch.frombuffer(self.map, dtype=dtype, count=count, offset=at) if count else \
                torch.empty(0, dtype=dtype)
            self.views[key] = flat.view(shape)
        self.step = -1
        self.timeline = -1


class Snapshots:
    """This rank's two slots under `<root>/<job>/`, written in turn."""

    def __init__(self, root: Path, *, job_id: str, attempt: int, rank: int, world_size: int,
                 recent: Callable[[], list[bytes]] = list) -> None:
        self.root, self.job_id, self.attempt, self.rank, self.world_size = root, job_id, attempt, rank, world_size
        self.recent = recent  # the rank's newest step reports (Emitter.recent_steps), for each header
        self._layout: _Layout | None = None
        self._slots: list[_Slot] = []
        self._offsets: list[int] = []
        self._size = 0
        self._next = 0
        self._copier: HostCopier | None = None
        # One worker thread for the rank's snapshots, fed by a queue: a thread started per snapshot held the loop
        # for its start handshake, 8 ms on a loaded box, more than the rest of a snapshot
        self._jobs: queue.SimpleQueue[tuple[tuple[Any, ...], threading.Event] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._done: threading.Event | None = None  # set once the newest snapshot's header is written
        self._error: BaseException | None = None
        self._seen_generation: int | None = None
        self._planned: dict[int, int | None] = {}  # each slot's copy plan: the generation it was made for
        self._seen: tuple[list[tuple[str, torch.Size, torch.dtype, int]], dict[str, Any],
                          dict[str, list[int]]] | None = None
        self.taken = 0
        self.last_stall_s = 0.0  # the newest snapshot's hold of the training thread
        self.last_background_s = 0.0  # ... and the CPU it took beside it (its copy's threads, its worker), once done
        self._copying: list[Future[float]] = []  # the copy of the settled items, running beside training
        # Totals over this process: the training thread's stalls and the CPU beside it, for what snapshots cost.
        self.stall_total_s = 0.0
        # which of live's keys are tensors, which not, which copied on the training thread: by (generation, count
        # of items, settled keys)
        self._splits: tuple[tuple[int | None, int, Collection[str]], tuple[str, ...], tuple[str, ...],
                            list[str]] | None = None
        self._packs: dict[str, tuple[Any, fmt.Item]] = {}  # the last packed value of each item not a tensor
        self._items: dict[str, tuple[tuple[Any, ...], fmt.Item]] = {}  # each tensor's item, but its digest
        self.worker_cpu_total_s = 0.0
        self._digester = Digester()  # the items' sums, in a helper process: off this process's GIL
        self._base_items: tuple[tuple[_Layout, dict[str, Any], dict[str, list[int]]] | None, list[fmt.Item]] = \
            (None, [])

    def _prepare(self, tensors: dict[str, torch.Tensor]) -> None:
        local = {k: _local(t) for k, t in tensors.items()}
        layout = _Layout(tuple(local), tuple(tuple(t.shape) for t in local.values()),
                         tuple(_dtype_name(t.dtype) for t in local.values()))
        if layout == self._layout:
            return
        offsets, at = [], 0
        for t in local.values():
            offsets.append(at)
            at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        need = fmt.rank_need(at)
        (self.root / self.job_id).mkdir(parents=True, exist_ok=True)
        mine = sum(s.map.size() for s in self._slots)  # what this rank's slots hold already counts as free
        if fmt.free_bytes(self.root) + mine < need:
            raise SnapshotsOff(f"the node's snapshot memory {self.root} has {fmt.free_bytes(self.root) + mine} bytes "
                               f"free, two snapshots of this rank need {2 * at} (with {fmt.MARGIN}x to spare)")
        for slot in self._slots:
            slot.map.close()
        self._layout, self._offsets, self._size = layout, offsets, at
        self._slots = [_Slot(fmt.slot_dir(self.root, self.job_id, self.attempt, self.rank, k), self.rank, layout,
                             offsets, at) for k in range(fmt.SLOTS)]
        for slot in self._slots:  # fault the pages in now, not during the first snapshot's stall
            for view in slot.views.values():
                view.zero_()

    def take(self, step: int, live: dict[str, Any], position: DataPosition, *, timeline: int, checkpointing: bool,
             replicated: bool, layout: Sequence[int] = (), settled: Collection[str] = (),
             generation: int | None = None) -> float:
        """Copy `live` (what TrainState.live gives, plus the checkpoint's META item) into the older slot;
        returns the stall in seconds. Its header is written by a worker once the checksums are summed.

        The items of `settled` (what only the optimizer's step writes: the parameters, the optimizer's state) are
        copied on the copier's threads while the step's forward and backward run; `copied()` waits for them and
        must come before anything writes them (the optimizer's pre-step hook, the next boundary). `generation`:
        which tensors over which memory `live` holds (TrainState.generation; None: unknown): a snapshot of the
        generation the layout, or a slot's copy plan, was made for keeps it unchecked."""
        started = time.perf_counter()
        self.wait()
        tensors, others, inline = self._split(live, settled, generation)
        # the same items, shapes and dtypes as the last snapshot's (as they are, step after step; a DTensor's chunk
        # also by its object): its layout, chunks and shapes stand, and building them anew was a third of the stall
        known = generation is not None and self._seen is not None and generation == self._seen_generation
        seen = self._seen[0] if known and self._seen is not None else \
            [(k, t.shape, t.dtype, id(t) if isinstance(t, DTensor) else 0) for k, t in tensors.items()]
        self._seen_generation = generation
        if self._seen is not None and self._seen[0] == seen:
            chunks, shapes = self._seen[1], self._seen[2]
        else:
            self._prepare(tensors)
            chunks = {k: _create_chunk_from_dtensor(t) if isinstance(t, DTensor) else None for k, t in tensors.items()}
            shapes = {k: list(t.shape) for k, t in tensors.items()}
            self._seen = (seen, chunks, shapes)
        index, slot = self._next, self._slots[self._next]
        self._next = (self._next + 1) % fmt.SLOTS
        planned = generation is not None and self._planned.get(index) == generation
        self._planned[index] = generation
        slot.header.unlink(missing_ok=True)  # incomplete from here until its header is written again
        self._copier = self._copier or HostCopier()
        self._copier.copy(tensors, slot.views, inline)
        if settled:
            self._copying = self._copier.start(tensors, slot.views, settled, same=planned)
        stall = time.perf_counter() - started
        args = (slot, step, position, timeline, checkpointing, replicated, others, chunks, shapes, self._copying,
                self.recent(), list(layout))
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name=f"snapshots-r{self.rank}", daemon=True)
            self._worker.start()
        self._done = threading.Event()
        self._jobs.put((args, self._done))
        self.taken += 1
        self.last_stall_s = stall
        self.stall_total_s += stall
        return stall

    def _split(self, live: dict[str, Any], settled: Collection[str], generation: int | None,
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any], Sequence[str]]:
        """`live`'s tensors, the rest (kept apart from what the script changes while the worker packs them), and the
        tensors to copy on this thread (those not `settled`). Which key is which stands while the generation does
        (the same cached items, the same RNG, extras and META keys), so only the few values not tensors, an
        optimizer group's learning rate among them, are looked at anew: a pass over every item was 50 us each."""
        split = self._splits
        if generation is None or split is None or split[0] != (generation, len(live), settled) or \
                any(isinstance(live[k], torch.Tensor) for k in split[2]):
            tensor_keys = tuple(k for k, v in live.items() if isinstance(v, torch.Tensor))
            split = self._splits = ((generation, len(live), settled), tensor_keys,
                                    tuple(k for k, v in live.items() if not isinstance(v, torch.Tensor)),
                                    [k for k in tensor_keys if k not in settled])
        return {k: live[k] for k in split[1]}, {k: _kept(live[k]) for k in split[2]}, split[3]

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            args, done = job
            try:
                self._finish(*args)
            finally:
                done.set()

    def _finish(self, slot: _Slot, step: int, position: DataPosition, timeline: int, checkpointing: bool,
                replicated: bool, others: dict[str, Any], chunks: dict[str, Any], shapes: dict[str, list[int]],
                copying: list[Future[float]], steps: list[bytes], layout: list[int]) -> None:
        cpu, copy_cpu = time.thread_time(), 0.0
        try:
            for part in copying:
                copy_cpu += part.result()
            assert self._layout is not None
            bases = self._bases(slot, chunks, shapes)
            view = memoryview(slot.map)
            try:
                digests = self._digester.digests(slot.folder / fmt.bin_name(self.rank),
                                                 [(item.at, item.nbytes) for item in bases], view)
            finally:
                view.release()
            copy_cpu += self._digester.cpu_s
            items = [msgspec.structs.replace(item, digest=d) for item, d in zip(bases, digests, strict=True)]
            for key, value in others.items():
                items.append(self._packed(key, value))
            header = fmt.Header(format=fmt.FORMAT, job_id=self.job_id, attempt=self.attempt, rank=self.rank,
                                world_size=self.world_size, step=step, timeline=timeline, data=position,
                                checkpointing=checkpointing, replicated=replicated, bin_bytes=self._size, items=items,
                                steps=steps, layout=layout)
            tmp = slot.header.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode(header))
            os.replace(tmp, slot.header)
            slot.step, slot.timeline = step, timeline
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc
        finally:
            # CPU, not wall time: what it can take from training is the cores it runs on
            beside = time.thread_time() - cpu + copy_cpu
            self.worker_cpu_total_s += beside
            self.last_background_s = beside

    def _bases(self, slot: _Slot, chunks: dict[str, Any], shapes: dict[str, list[int]]) -> list[fmt.Item]:
        """Each tensor's item but its digest, in the slot's order: the last list while the layout, chunks and shapes
        are the same objects (take keeps them while the items stay)."""
        assert self._layout is not None
        known = self._base_items[0]
        if known is None or known[0] is not self._layout or known[1] is not chunks or known[2] is not shapes:
            bases = [self._item(key, at, dtype, slot.views[key], shapes[key], chunks[key])
                     for key, at, dtype in zip(self._layout.keys, self._offsets, self._layout.dtypes, strict=True)]
            self._base_items = ((self._layout, chunks, shapes), bases)
        return self._base_items[1]

    def _item(self, key: str, at: int, dtype: str, view: torch.Tensor, shape: list[int], chunk: Any) -> fmt.Item:
        """A tensor's item but its digest: the last one's while its place and shape stay (they do, step after step;
        building a few hundred anew was most of the worker's time)."""
        sig = (at, dtype, tuple(shape), None if chunk is None else (tuple(chunk.offsets), tuple(chunk.sizes)))
        known = self._items.get(key)
        if known is not None and known[0] == sig:
            return known[1]
        item = fmt.Item(key=key, dtype=dtype, shape=shape, offsets=list(chunk.offsets) if chunk else [0] * view.dim(),
                        sizes=list(chunk.sizes) if chunk else list(view.shape), at=at,
                        nbytes=view.numel() * view.element_size())
        self._items[key] = (sig, item)
        return item

    def _packed(self, key: str, value: Any) -> fmt.Item:
        """An item that is not a tensor, packed by torch.save (a millisecond each): the last one's again while the
        value is equal (an optimizer's betas, its parameters' names, an extra that did not move)."""
        known = self._packs.get(key)
        if known is not None and _same(known[0], value):
            return known[1]
        buf = io.BytesIO()
        # the legacy pickle format: 20-40 us an item where the zip format took 100-250 (torch.load reads either)
        torch.save(value, buf, _use_new_zipfile_serialization=False)
        packed = buf.getvalue()
        item = fmt.Item(key=key, digest=fmt.digest(packed), packed=packed)
        self._packs[key] = (value, item)
        return item

    def copied(self) -> None:
        """Return once the copy running beside training is done (its failure is the worker's to report)."""
        copying, self._copying = self._copying, []
        for part in copying:
            with contextlib.suppress(BaseException):  # surfaced by wait(), through the worker
                part.result()

    def wait(self) -> None:
        if self._done is not None:
            self._done.wait()
            self._done = None
        if self._error is not None:
            error, self._error = self._error, None
            raise SnapshotsOff(f"writing a snapshot failed: {error!r}") from error

    def close(self) -> None:
        """Finish the header being written; the slots stay (they are the node's, not this process's)."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._jobs.put(None)
                self._worker = None
            if self._copier is not None:
                self._copier.close()
            self._digester.close()


def headers_in(folder: Path) -> list[fmt.Header]:
    """Every snapshot header in `folder` (a slot, or a set persisted from several), by rank."""
    headers = [fmt.read_header(p) for p in sorted(folder.glob("r*.json"))]
    return sorted(headers, key=lambda h: h.rank)


def is_snapshot(folder: Path) -> bool:
    return not (folder / ".metadata").exists() and any(folder.glob("r*.json"))


class SnapshotReader(StorageReader):
    """DCP's reader over snapshot slots: the metadata is every header's items (a chunk held by several ranks,
    a replicated tensor, is read from the lowest of them); each tensor is checked against its checksum as read."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.headers = headers_in(self.folder)
        if not self.headers:
            raise fmt.BadSnapshot(f"{self.folder} holds no snapshot header")
        steps = {(h.job_id, h.step, h.timeline, h.world_size) for h in self.headers}
        if len(steps) > 1:
            raise fmt.BadSnapshot(f"{self.folder} mixes snapshots of different steps or jobs: {sorted(steps)}")
        self._where: dict[MetadataIndex, tuple[int, fmt.Item]] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._by_rank = {h.rank: h for h in self.headers}

    @property
    def header(self) -> fmt.Header:
        return self.headers[0]

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_snapshot(Path(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self._where = {}
        for h in self.headers:
            for item in h.items:
                if item.packed or not item.dtype:
                    md.setdefault(item.key, BytesStorageMetadata())
                    self._where.setdefault(MetadataIndex(item.key), (h.rank, item))
                    continue
                chunk = ChunkStorageMetadata(offsets=torch.Size(item.offsets), sizes=torch.Size(item.sizes))
                index = MetadataIndex(item.key, torch.Size(item.offsets))
                if index in self._where:
                    continue
                self._where[index] = (h.rank, item)
                entry = md.get(item.key)
                if not isinstance(entry, TensorStorageMetadata):
                    entry = md[item.key] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=_dtype(item.dtype)), size=torch.Size(item.shape), chunks=[])
                entry.chunks.append(chunk)
        return Metadata(state_dict_metadata=md, storage_data=dict(self._where))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data:
            self._where = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _map(self, rank: int) -> mmap.mmap:
        if rank not in self._maps:
            with (self.folder / fmt.bin_name(rank)).open("rb") as f:  # private pages: torch asks for a writable buffer
                self._maps[rank] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[rank]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        try:
            for req in plan.items:
                rank, item = self._where[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    if not fmt.matches(self._by_rank[rank], item, item.packed):
                        raise fmt.BadSnapshot(f"snapshot {self.folder}: {item.key!r} does not match its checksum")
                    planner.load_bytes(req, io.BytesIO(item.packed))
                    continue
                data = self._map(rank)
                if item.at + item.nbytes > len(data):
                    raise fmt.BadSnapshot(f"snapshot {self.folder}: {item.key!r} lies outside r{rank}.bin")
                raw = memoryview(data)[item.at:item.at + item.nbytes]
                if not fmt.matches(self._by_rank[rank], item, raw):
                    raise fmt.BadSnapshot(f"snapshot {self.folder}: {item.key!r} (rank {rank}) does not match its "
                                          "checksum: torn or changed after it was taken")
                dtype = _dtype(item.dtype)
                source = (torch.frombuffer(raw, dtype=dtype) if item.nbytes else torch.empty(0, dtype=dtype))
                source = source.view(item.sizes)
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    source = source.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != source.size():
                    raise fmt.BadSnapshot(f"snapshot {self.folder}: {item.key!r} is {tuple(source.size())} where "
                                          f"{tuple(target.size())} was asked for")
                target.copy_(source)
                planner.commit_tensor(req, target)
                del source, raw
        finally:
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:  # a view still lives somewhere: the map goes with it
                    pass
            self._maps.clear()
        fut: TorchFuture[None] = TorchFuture()
        fut.set_result(None)
        return fut


def position_of(folder: Path) -> tuple[int, DataPosition]:
    h = SnapshotReader(folder).header
    return h.step, h.data

