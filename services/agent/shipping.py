"""The node agent puts its own ranks' staged checkpoint shards into the object store, so no other host ever
reads this node's disk: it follows its ranks' CheckpointStaged announcements (a filtered read of the telemetry
stream, one per job attempt it runs), uploads each announced file from the node's staging folder, checks the
bytes it sent against the rank's size and sha256, and reports the node's part of each set as one
ShardsUploaded. The checkpoint service reads the store back and writes the manifest last.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointStaged, ShardInfo, ShardsUploaded, checkpoint_id
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.agent.launch import detached
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.store import ObjectStore, local_path

log = structlog.get_logger("flightdeck.agent.shipping")

FILE_CONCURRENCY = 4  # uploads in flight per node


class NotStored(Exception):
    """Why a rank's shards were not stored; becomes ShardsUploaded.failed."""


def _job_set(real: Path, root: Path, job_id: str) -> bool:
    """`real` is <root>/.../<job_id>/<set>: a set in a folder named after the job, that folder inside `root`."""
    folder = real.parent
    return folder.name == job_id and folder != root and folder.is_relative_to(root)


def confine(job_id: str, staged: CheckpointStaged, roots: Sequence[Path]) -> Path:
    """The announced staging dir with symlinks resolved, if it is a set of `job_id`'s inside one of `roots`.
    Whoever may publish the job's telemetry can announce any path: only the job's own sets are read."""
    where = f"rank {staged.rank} announced the staging dir {staged.staging_dir!r}"
    announced = Path(staged.staging_dir)
    if not announced.is_absolute():
        raise NotStored(f"{where}: not an absolute path; nothing was uploaded")
    try:
        real = announced.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, unreadable, a symlink loop
        raise NotStored(f"{where}, which cannot be resolved ({type(exc).__name__}: {exc}); "
                        "nothing was uploaded") from None
    if not real.is_dir():
        raise NotStored(f"{where}, which resolves to {real}, not a folder; nothing was uploaded")
    real_roots = [r.resolve() for r in roots]
    inside_roots = [r for r in real_roots if real != r and real.is_relative_to(r)]
    if not inside_roots:
        raise NotStored(f"{where}, which resolves to {real}, outside the staging roots "
                        f"{[str(r) for r in real_roots]}; nothing was uploaded")
    if not any(_job_set(real, r, job_id) for r in inside_roots):
        raise NotStored(f"{where}, which resolves to {real}: not a set of job {job_id}'s "
                        f"(<staging root>/{job_id}/<set>); nothing was uploaded")
    return real


async def _put_shard(objects: ObjectStore, key_of: str, staged: CheckpointStaged, folder: Path,
                     shard: ShardInfo) -> int:
    where = f"shard {shard.path!r} of rank {staged.rank}"
    try:
        local = local_path(folder, shard.path).resolve()  # uploaded by its real path: checked, not re-followed
        key = mf.shard_key(staged.job_id, key_of, shard.path)
    except ValueError as exc:
        raise NotStored(f"{where}: {exc}") from None
    try:
        size, sha = await objects.put_file(key, local)
    except (FileNotFoundError, IsADirectoryError):
        raise NotStored(f"{where} is missing from {staged.staging_dir}") from None
    if (size, sha) != (shard.size, shard.sha256):
        raise NotStored(f"{where} is corrupt: staged {size} bytes with sha256 {sha}, the rank announced "
                        f"{shard.size} bytes with {shard.sha256}")
    return size


async def store_rank(objects: ObjectStore, staged: CheckpointStaged, roots: Sequence[Path],
                     slots: asyncio.Semaphore | None = None) -> int:
    """Upload one rank's announced shards from its set under `roots` into the checkpoint's prefix, each checked
    against the announcement as it is sent. Returns the bytes stored; raises NotStored saying why not."""
    folder = await asyncio.to_thread(confine, staged.job_id, staged, roots)
    cid = checkpoint_id(staged.attempt, staged.step, staged.timeline)
    slots = slots or asyncio.Semaphore(FILE_CONCURRENCY)
    errors: list[BaseException] = []

    async def one(shard: ShardInfo) -> int:
        async with slots:
            if errors:  # one bad shard dooms the set: start no more uploads
                return 0
            try:
                return await _put_shard(objects, cid, staged, folder, shard)
            except Exception as exc:  # whatever the store raised: the set is not stored, and the report says why
                errors.append(exc)
                return 0

    # uploads already running are let finish rather than cancelled: a local store's write runs in a thread that
    # a cancel would not stop
    sizes = await asyncio.gather(*(one(s) for s in staged.shards))
    if errors:
        first = next((e for e in errors if isinstance(e, NotStored)), errors[0])
        raise first if isinstance(first, NotStored) else NotStored(f"upload failed: {type(first).__name__}: {first}")
    return sum(sizes)


@dataclass
class _Set:
    """One checkpoint set as this node stores it: its ranks' uploads, reported together."""

    world_size: int
    started: float  # monotonic, the first announcement seen
    stored: dict[int, int] = field(default_factory=dict)  # rank -> bytes
    reported: bool = False
    failed: bool = False


@dataclass
class _Watch:
    job_id: str
    attempt: int
    ranks: frozenset[int]  # the job's ranks this node runs in the attempt
    next_seq: int
    sets: dict[tuple[int, int], _Set] = field(default_factory=dict)  # (timeline, step)
    uploads: set[asyncio.Task[None]] = field(default_factory=set)
    follower: asyncio.Task[None] | None = None
    reports: int = 0


class Shipper:
    """Ships the staged sets of the ranks this agent runs; `watch` when ranks start, `finish` once they exited."""

    def __init__(self, *, node: str, producer: str, store: EventStore, objects: ObjectStore, staging: Path,
                 snapshots: Path | None = None) -> None:
        self.node, self.producer, self.store, self.objects = node, producer, store, objects
        self.roots = [staging, *([snapshots] if snapshots is not None else [])]  # a persisted snapshot is a set too
        self.slots = asyncio.Semaphore(FILE_CONCURRENCY)
        self.watches: dict[tuple[str, int], _Watch] = {}

    @staticmethod
    def filters(job_id: str, ranks: frozenset[int]) -> list[str]:
        return [subjects.telemetry(job_id, r, "CheckpointStaged") for r in sorted(ranks)]

    async def start_seq(self) -> int:
        """Where a watch for ranks about to start begins: nothing they stage can come before it."""
        return await self.store.last_seq(subjects.TELEMETRY) + 1

    def watch(self, job_id: str, attempt: int, ranks: Sequence[int], from_seq: int) -> None:
        key = (job_id, attempt)
        if key in self.watches:
            return
        w = _Watch(job_id=job_id, attempt=attempt, ranks=frozenset(ranks), next_seq=from_seq)
        w.follower = asyncio.create_task(self._follow(w))
        self.watches[key] = w

    async def _follow(self, w: _Watch) -> None:
        detached(self.producer, job_id=w.job_id, attempt=w.attempt)
        async for stored in self.store.follow(subjects.TELEMETRY, self.filters(w.job_id, w.ranks),
                                              from_seq=w.next_seq):
            self._take(w, stored)

    def _take(self, w: _Watch, stored: Stored) -> None:
        w.next_seq = max(w.next_seq, stored.seq + 1)
        ev = stored.event
        if not isinstance(ev, CheckpointStaged) or (ev.job_id, ev.attempt) != (w.job_id, w.attempt) \
                or ev.rank not in w.ranks:
            return  # another attempt's ranks (a pid reused), or junk: not this node's to store
        at = (ev.timeline, ev.step)
        s = w.sets.get(at)
        if s is None:
            s = w.sets[at] = _Set(world_size=ev.world_size, started=time.monotonic())
        elif s.failed:
            return
        task = asyncio.create_task(self._store(w, s, ev))
        w.uploads.add(task)
        task.add_done_callback(w.uploads.discard)

    async def _store(self, w: _Watch, s: _Set, ev: CheckpointStaged) -> None:
        detached(self.producer, job_id=w.job_id, attempt=w.attempt, rank=ev.rank, step=ev.step)
        try:
            s.stored[ev.rank] = await store_rank(self.objects, ev, self.roots, self.slots)
        except NotStored as exc:
            s.failed = True
            log.warning("staged shards not stored", reason=str(exc))
            await self._report(w, (ev.timeline, ev.step), [ev.rank], s, failed=str(exc))
            return
        again = s.reported  # a rank that staged the set again after the node reported it
        if again or set(s.stored) >= w.ranks:
            ranks = [ev.rank] if again else sorted(s.stored)
            s.reported = True
            await self._report(w, (ev.timeline, ev.step), ranks, s)

    async def _report(self, w: _Watch, at: tuple[int, int], ranks: list[int], s: _Set, failed: str = "") -> None:
        (timeline, step), w.reports = at, w.reports + 1
        stored = sum(s.stored.get(r, 0) for r in ranks)
        seconds = round(time.monotonic() - s.started, 3)
        report = ShardsUploaded(
            job_id=w.job_id, rank=min(ranks), attempt=w.attempt, node=self.node, step=step, timeline=timeline,
            world_size=s.world_size, ranks=ranks, bytes=stored, seconds=seconds, failed=failed,
            event_id=f"{self.producer}:stored:{w.job_id}:{w.attempt}:{timeline}:{step}:{w.reports}",
            occurred_at=time.time(), producer=self.producer)
        subject = subjects.telemetry(w.job_id, report.rank, "ShardsUploaded")
        delay = 0.2
        while True:  # a set whose report is lost never commits: retry through a broker outage
            try:
                await self.store.append(subject, report, msg_id=report.event_id)
                break
            except Exception as exc:
                log.warning("could not report stored shards; retrying", error=repr(exc), delay_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
        if not failed:
            log.info("staged shards stored", step=step, ranks=ranks, bytes=stored, seconds=seconds)

    async def finish(self, job_id: str, attempt: int) -> None:
        """The attempt's ranks here have exited: store what they announced up to now (a rank checkpoints on its
        way out), then stop watching."""
        w = self.watches.get((job_id, attempt))
        if w is None:
            return
        if w.follower is not None:
            w.follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w.follower
        try:
            until = await self.store.last_seq(subjects.TELEMETRY)
            if until >= w.next_seq:
                async for batch in self.store.read(subjects.TELEMETRY, self.filters(job_id, w.ranks),
                                                   from_seq=w.next_seq, until_seq=until):
                    for stored in batch:
                        self._take(w, stored)
        except Exception as exc:  # the broker is away: what is left unread here is never committed
            log.warning("could not read the last stagings of an attempt", job_id=job_id, attempt=attempt,
                        error=repr(exc))
        while w.uploads:
            await asyncio.gather(*list(w.uploads), return_exceptions=True)
        for at, s in sorted(w.sets.items(), reverse=True):
            # what the ranks here staged is all they will: a set some never staged (a crashed rank's agent stages
            # only the older snapshots it has) is this node's whole part of it
            if s.stored and not s.reported and not s.failed:
                s.reported = True
                await self._report(w, at, sorted(s.stored), s)
        self.watches.pop((job_id, attempt), None)

    async def close(self) -> None:
        for w in list(self.watches.values()):
            for task in [w.follower, *w.uploads]:
                if task is not None:
                    task.cancel()
        self.watches.clear()
