"""The node's copies of jobs' shipped code (services/shell/objects/code.py): each archive fetched from the object
store once, checked against its address, unpacked under `<data dir>/code/<sha256>/` and kept for the job's next
attempts (and any job shipping the same bytes). The ranks run in that copy.

An unpack goes to a temporary folder renamed into place, so a copy that exists is whole; an agent killed halfway
leaves only the temporary folder, removed at its next start. At most KEEP copies stay, the least recently used
going first, never one a rank here runs in.
"""

import asyncio
import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import structlog

from flightdeck.events.spec import JobSpec
from flightdeck.services.shell.objects import code
from flightdeck.services.shell.objects.store import ObjectNotFound, ObjectStore, ObjectTooLarge

log = structlog.get_logger("flightdeck.agent")

KEEP = 16  # copies of shipped code kept on a node
UNPACK_LIMIT_FACTOR = 10  # a node unpacks up to this many times the submit-side cap ($FLIGHTDECK_CODE_MAX_MB)


class CodeCache:
    def __init__(self, *, root: Path, objects: ObjectStore, keep: int = KEEP) -> None:
        self.root, self.objects, self.keep = root / "code", objects, keep
        self._locks: dict[str, asyncio.Lock] = {}
        for leftover in self.root.glob(".tmp-*") if self.root.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)  # an unpack the last agent here did not finish

    async def folder(self, spec: JobSpec, in_use: Collection[str] = ()) -> Path | None:
        """The folder the job's ranks run in (its `entrypoint.cwd` inside the node's copy of its shipped code),
        or None for a job that ships none. CodeError when the code is missing, damaged or unsafe (no restart can
        change that); the object store's own errors otherwise (a retry may do better)."""
        entry = spec.entrypoint
        if entry is None or not entry.code:
            return None
        copy = await self.copy(entry.code, in_use)
        where = (copy / entry.cwd).resolve()
        if not where.is_relative_to(copy) or not where.is_dir():
            raise code.CodeError(f"entrypoint.cwd {entry.cwd!r} is not a folder in the shipped code {entry.code}")
        return where

    async def copy(self, address: str, in_use: Collection[str] = ()) -> Path:
        """This node's whole copy of the code at `address`, fetched and unpacked if it has none yet."""
        key = code.key_of(address)
        digest = address.removeprefix("sha256:")
        dest = self.root / digest
        async with self._locks.setdefault(digest, asyncio.Lock()):
            if dest.is_dir():
                os.utime(dest)  # recently used: kept before older copies
                return dest
            limit = code.max_bytes() * UNPACK_LIMIT_FACTOR
            started = time.monotonic()
            try:
                data = await self.objects.get_bytes(key, max_bytes=limit)
            except ObjectNotFound:
                raise code.CodeError(f"the job's code {address} is not in the object store ({self.objects.uri(key)}): "
                                     "was it submitted to another platform, or deleted?") from None
            except ObjectTooLarge:
                raise code.CodeError(f"the job's code {address} is larger than this node takes "
                                     f"({limit / 1e6:,.0f} MB)") from None
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".tmp-{digest}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                await asyncio.to_thread(code.unpack, data, address, tmp, limit=limit)
                os.rename(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("job code unpacked", address=address, archive_mb=round(len(data) / 1e6, 2), path=str(dest),
                     took_s=round(time.monotonic() - started, 3))
        await asyncio.to_thread(self._evict, {*in_use, digest})
        return dest

    def _evict(self, in_use: Collection[str]) -> None:
        copies = sorted((p for p in self.root.iterdir() if not p.name.startswith(".")),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in copies[self.keep:]:
            if old.name not in in_use:
                shutil.rmtree(old, ignore_errors=True)
                log.info("job code evicted", path=str(old))
