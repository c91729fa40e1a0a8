"""The CPU snapshot's copy, spread over a few threads: one thread's memcpy is about half of what this machine's
memory gives (bench/checkpoint_stall.py: 49 ms for 300 MB on one thread, 29 ms on two), and `Tensor.copy_`
releases the GIL, so the loop is blocked for less time. On CUDA the copy is queued on a side stream instead.

The bytes are cut into about equal ranges, one per thread, across tensor boundaries: a state of one big tensor
spreads as well as many small ones. A tensor that is not contiguous is copied whole by one thread."""

import os
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

MAX_THREADS = 4  # past this the copy is bound by memory bandwidth, not by threads
# Less than this is copied on the calling thread alone: handing a few kilobytes (a snapshot's RNG state and buffers)
# to the pool cost a thread switch each way, milliseconds on a loaded box, for microseconds of copying
INLINE_BYTES = 1 << 20
THREADS_ENV = "FLIGHTDECK_SNAPSHOT_THREADS"

Pair = tuple[torch.Tensor, torch.Tensor]  # (source, destination)


def default_threads() -> int:
    """$FLIGHTDECK_SNAPSHOT_THREADS, else the CPUs this process may run on, at most MAX_THREADS."""
    raw = os.environ.get(THREADS_ENV, "")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{THREADS_ENV}={raw!r}: give a whole number of threads, 1 to {MAX_THREADS * 4}") from None
        if not 1 <= n <= MAX_THREADS * 4:
            raise ValueError(f"{THREADS_ENV}={n}: give 1 to {MAX_THREADS * 4}")
        return n
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def split(pairs: list[Pair], parts: int) -> list[list[Pair]]:
    """`pairs` cut into `parts` lists of about equal bytes (slices of flat views; non-contiguous tensors whole)."""
    flat: list[Pair] = []
    whole: list[Pair] = []
    for src, dst in pairs:
        if src.is_contiguous() and dst.is_contiguous() and src.shape == dst.shape and src.dtype == dst.dtype:
            flat.append((src.reshape(-1), dst.reshape(-1)))
        else:
            whole.append((src, dst))
    size = sum(s.numel() * s.element_size() for s, _ in flat)
    share = -(-size // parts) if size else 0
    out: list[list[Pair]] = [[] for _ in range(parts)]
    i, room = 0, share
    for src, dst in flat:
        per = src.element_size()
        off, n = 0, src.numel()
        while off < n:
            take = n - off if i == parts - 1 else min(n - off, max(1, room // per))
            out[i].append((src[off:off + take], dst[off:off + take]))
            off += take
            room -= take * per
            if room <= 0 and i < parts - 1:
                i, room = i + 1, share
    for k, pair in enumerate(whole):
        out[k % parts].append(pair)
    return out


class HostCopier:
    """Copies a state's tensors into host buffers of the same layout, over `threads` threads."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="snapshot") if self.threads > 1 else None
        # Each destination's last plans and what they copied from (the same tensors over the same memory): cutting a
        # few hundred tensors into ranges costs milliseconds that a snapshot every step would pay each time.
        self._plans: dict[tuple[int, bool], tuple[dict[str, tuple[int, int, int]], list[list[Pair]], int]] = {}

    def _parts(self, live: dict[str, Any], buffers: dict[str, Any], keys: Collection[str] | None,
               background: bool) -> tuple[list[list[Pair]], list[Pair], int]:
        """The copy cut into per-thread parts, the pairs to copy after them (those whose source changed since
        the plan, when few: what the plan copied of them is overwritten), and the bytes the parts hold."""
        sources = {k: t for k in (buffers if keys is None else keys)
                   if k in buffers and isinstance(t := live.get(k), torch.Tensor)}
        # the destination's memory too: a dict's id can be reused by the next slot's views
        marks = {k: (id(t), getattr(t, "_local_tensor", t).data_ptr(), _local(buffers[k]).data_ptr())
                 for k, t in sources.items()}
        known = self._plans.get((id(buffers), background))
        changed = [k for k, m in marks.items() if known is None or known[0].get(k) != m]
        if known is not None and marks.keys() == known[0].keys() and (not background or not changed) and \
                sum(sources[k].nelement() for k in changed) * 16 <= sum(t.nelement() for t in sources.values()):
            return known[1], [(_local(sources[k]), _local(buffers[k])) for k in changed], known[2]
        pairs = [(_local(t), _local(buffers[k])) for k, t in sources.items()]
        size = sum(s.numel() * s.element_size() for s, _ in pairs)
        inline = self._pool is None or size < INLINE_BYTES
        # Beside training, only the cores torch's threads leave: two copy threads beside a training thread on two
        # cores took one from it, and slowed every step by more than the copy saved
        threads = max(1, min(self.threads, len(os.sched_getaffinity(0)) - torch.get_num_threads())) \
            if background else self.threads
        parts = [pairs] if inline else [part for part in split(pairs, threads) if part]
        self._plans[(id(buffers), background)] = (marks, parts, size)
        return parts, [], size

    def copy(self, live: dict[str, Any], buffers: dict[str, Any], keys: Collection[str] | None = None) -> None:
        """Copy `live`'s tensors (those of `keys`, default all) into `buffers`; returns when they are copied."""
        parts, late, _ = self._parts(live, buffers, keys, background=False)
        if parts:
            futures = [self._pool.submit(_run, part) for part in parts[1:]] if self._pool is not None else []
            _run(parts[0])  # this thread copies a share too, rather than wait idle
            for f in futures:
                f.result()
        _run(late)

    def start(self, live: dict[str, Any], buffers: dict[str, Any], keys: Collection[str], *,
              same: bool = False) -> list[Future[float]]:
        """Copy the tensors of `keys` on the copier's threads and return at once: each future gives its thread's
        CPU seconds. With a single thread it copies them here (nothing left to wait for). `same`: the caller knows
        the tensors are those of the last copy into `buffers`, over the same memory: its plan stands unchecked."""
        known = self._plans.get((id(buffers), True)) if same else None
        parts, _, size = (known[1], [], known[2]) if known is not None else \
            self._parts(live, buffers, keys, background=True)
        if self._pool is None or size < INLINE_BYTES:
            _run([pair for part in parts for pair in part])
            return []
        return [self._pool.submit(_run, part) for part in parts]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


@torch.no_grad()
def _run(pairs: list[Pair]) -> float:
    started = time.thread_time()
    if pairs:
        # one call, so the GIL is let go once: a copy_ per tensor took it back a few hundred times a snapshot,
        # each time from the training thread
        torch._foreach_copy_([dst for _, dst in pairs], [src for src, _ in pairs])
    return time.thread_time() - started
