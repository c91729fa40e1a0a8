"""The node agent's cache of committed checkpoints: downloads verified against their manifests, one at a time per
checkpoint, prefetched on commit; a restart's copy is checked again before ranks load it.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import contextlib
import functools
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from flightdeck.services.agent.core import Restore
from flightdeck.services.agent.launch import Paths, detached
from flightdeck.services.shell.objects import manifest
from flightdeck.services.shell.objects.store import ObjectStore

log = structlog.get_logger("flightdeck.agent")
Ready = Callable[[str, str], None]  # (path, problem): where a rollback's copy is, or why there is none


class CheckpointCache:
    def __init__(self, *, node_paths: Paths, objects: ObjectStore, producer: str) -> None:
        self.node_paths, self.objects, self.producer = node_paths, objects, producer
        self.tasks: dict[tuple[str, str], asyncio.Task[Path]] = {}

    def cancel_all(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    def fetch_task(self, job_id: str, checkpoint: Restore) -> asyncio.Task[Path]:
        """The download of `checkpoint` into the cache: one at a time per checkpoint, retried after a failure."""
        key = (job_id, checkpoint.checkpoint_id)
        task = self.tasks.get(key)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None \
                and not (task.result() / manifest.MANIFEST).is_file():
            task = None  # cached once, gone since (removed by hand, or the disk was wiped): download it again
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.create_task(self._download(job_id, checkpoint))
            task.add_done_callback(_report_fetch)
            self.tasks[key] = task
        return task

    def fetch_for_rollback(self, job_id: str, checkpoint: Restore, ready: Ready) -> None:
        """Ranks told to roll back wait for this copy (fetched again if it went missing): `ready(path, problem)`
        tells them where it is, or why it could not be fetched, so they refuse the rollback at once."""
        self.fetch_task(job_id, checkpoint).add_done_callback(functools.partial(_tell_ready, ready))

    async def verified_copy(self, job_id: str, checkpoint: Restore) -> Path:
        """The node's verified copy of the checkpoint a new attempt restores. The cached copy is checked again
        (its download was verified, but a disk can rot and people edit folders); a damaged one is evicted and
        downloaded again. A copy that fails in the store too raises CorruptCheckpoint."""
        path = await self.fetch(job_id, checkpoint)
        try:
            await asyncio.to_thread(manifest.verify_local, path, job_id=checkpoint.job_id or job_id,
                                    checkpoint_id=checkpoint.checkpoint_id, expected_sha256=checkpoint.manifest_sha256)
            return path
        except manifest.CorruptCheckpoint as exc:
            log.warning("cached checkpoint damaged; downloading it again", job_id=job_id,
                        checkpoint_id=checkpoint.checkpoint_id, error=str(exc))
        await self.evict(job_id, [checkpoint.checkpoint_id])
        return await self.fetch(job_id, checkpoint)

    async def fetch(self, job_id: str, checkpoint: Restore) -> Path:
        return await asyncio.shield(self.fetch_task(job_id, checkpoint))

    async def _download(self, job_id: str, checkpoint: Restore) -> Path:
        detached(self.producer, job_id=job_id, checkpoint_id=checkpoint.checkpoint_id)
        dest = self.node_paths.cache(job_id, checkpoint.checkpoint_id)
        if (dest / manifest.MANIFEST).is_file():  # downloads land whole and verified, or not at all
            return dest
        if dest.exists():  # a copy someone removed part of: fetched again
            await asyncio.to_thread(shutil.rmtree, dest, True)
        started = time.perf_counter()
        # another job's checkpoint (the spec's init_from) is read from that job's keys, kept under this job's
        got = await manifest.download(self.objects, checkpoint.job_id or job_id, checkpoint.checkpoint_id, dest,
                                      expected_sha256=checkpoint.manifest_sha256)
        log.info("checkpoint cached", bytes=got.bytes, seconds=round(time.perf_counter() - started, 3))
        return dest

    async def evict(self, job_id: str, checkpoint_ids: list[str]) -> None:
        for cid in checkpoint_ids or [c for j, c in self.tasks if j == job_id]:
            task = self.tasks.pop((job_id, cid), None)
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        targets = [self.node_paths.cache(job_id, c) for c in checkpoint_ids] or [self.node_paths.cache(job_id)]
        for target in targets:
            await asyncio.to_thread(shutil.rmtree, target, True)


def _tell_ready(ready: Ready, task: asyncio.Task[Path]) -> None:
    if task.cancelled():
        ready("", "its download was cancelled (the agent is stopping)")
    elif (exc := task.exception()) is not None:
        ready("", f"{type(exc).__name__}: {exc}")
    else:
        ready(str(task.result()), "")


def _report_fetch(task: asyncio.Task[Path]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("checkpoint prefetch failed; a restore will try again", error=repr(task.exception()))
