"""The embedded object store: a local directory (default `.flightdeck/objects`).

Every write lands in `<root>/.tmp`, is fsynced, then renamed (or hard-linked, for a conditional
create) into place, so a reader sees a whole object or none. Temp files left by a killed process
stay in `.tmp`, out of every listing, until the sweeper removes them.
"""

import asyncio
import builtins
import hashlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from flightdeck.services.shell.objects.store import (
    HASH_CHUNK,
    InvalidKey,
    ObjectAlreadyExists,
    ObjectNotFound,
    ObjectStoreError,
    ObjectTooLarge,
    hash_file,
    inside,
    local_path,
    validate_key,
    validate_prefix,
)

DEFAULT_ROOT = Path(".flightdeck/objects")
TMP = ".tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chunks_of_file(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            yield chunk


def _write_synced(tmp: Path, chunks: Iterable[bytes]) -> tuple[int, str]:
    """Write chunks to a new file and fsync it; returns (size, sha256) of what was written."""
    digest, size = hashlib.sha256(), 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()


class LocalStore:
    """An ObjectStore over a directory; safe against keys or symlinks that point outside it."""

    readback_after_put = True

    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()
        self.tmp_dir = self.root / TMP
        self.tmp_dir.mkdir(exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()

    def _path(self, key: str) -> Path:
        validate_key(key)
        if key.split("/", 1)[0] == TMP:
            raise InvalidKey(f"key {key!r} is inside {TMP!r}, which the local store keeps for its temp files")
        return local_path(self.root, key)

    def _place(self, key: str, chunks: Iterable[bytes], exclusive: bool) -> tuple[int, str]:
        dest = self._path(key)
        tmp = self.tmp_dir / uuid.uuid4().hex
        try:
            size, sha = _write_synced(tmp, chunks)
            dest.parent.mkdir(parents=True, exist_ok=True)
            inside(self.root, dest)  # again: a directory made by someone else could be a symlink by now
            try:
                if exclusive:
                    os.link(tmp, dest)  # fails if dest exists: the atomic conditional create
                else:
                    os.replace(tmp, dest)
            except FileExistsError:
                raise ObjectAlreadyExists(f"{self.uri(key)} already exists") from None
            except IsADirectoryError:
                raise ObjectStoreError(f"cannot write {key!r}: keys under it exist, so here it is a folder") from None
            _fsync_dir(dest.parent)
            return size, sha
        finally:
            tmp.unlink(missing_ok=True)

    async def put_file(self, key: str, path: Path) -> tuple[int, str]:
        return await asyncio.to_thread(self._place, key, _chunks_of_file(path), False)

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        await asyncio.to_thread(self._place, key, [data], if_none_match)

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        try:
            f = self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(f"{key!r} is not in {self.root}") from None
        with f:
            if max_bytes is None:
                return f.read()
            size = os.fstat(f.fileno()).st_size
            data = f.read(max_bytes + 1) if size <= max_bytes else b""  # +1: a file that grew is caught too
        if size > max_bytes or len(data) > max_bytes:
            raise ObjectTooLarge(f"{self.uri(key)} holds {max(size, len(data))} bytes, more than the {max_bytes} "
                                 "its reader accepts")
        return data

    async def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return await asyncio.to_thread(self._read, key, max_bytes)

    def _download(self, key: str, path: Path) -> tuple[int, str]:
        src = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            size, sha = _write_synced(tmp, _chunks_of_file(src))
            os.replace(tmp, path)
        except (FileNotFoundError, IsADirectoryError):
            if not src.is_file():
                raise ObjectNotFound(f"{key!r} is not in {self.root}") from None
            raise
        finally:
            tmp.unlink(missing_ok=True)
        return size, sha

    async def get_file(self, key: str, path: Path) -> tuple[int, str]:
        return await asyncio.to_thread(self._download, key, path)

    def _hash(self, key: str, bytes_per_s: float = 0.0) -> tuple[int, str]:
        try:
            return hash_file(self._path(key), bytes_per_s)
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(f"{key!r} is not in {self.root}") from None

    async def hash_object(self, key: str, *, bytes_per_s: float = 0.0) -> tuple[int, str]:
        return await asyncio.to_thread(self._hash, key, bytes_per_s)

    async def exists(self, key: str) -> bool:
        path = self._path(key)
        return await asyncio.to_thread(path.is_file)

    def _list(self, prefix: str) -> list[str]:
        validate_prefix(prefix)
        base = self.root if prefix == "" else self.root.joinpath(*prefix[:-1].split("/"))
        if not base.is_dir() or base.is_symlink():
            return []
        out = []
        for dirpath, dirnames, filenames in os.walk(base):  # does not follow symlinked folders
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if d != TMP]
                rel_dir = ""
            for name in filenames:
                if not os.path.islink(os.path.join(dirpath, name)):
                    out.append(f"{rel_dir}/{name}" if rel_dir else name)
        return sorted(out)

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list, prefix)

    def _delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        parent = path.parent
        while parent != self.root:  # drop folders the delete emptied, so listings stay tidy
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._delete, key)

    async def delete_prefix(self, prefix: str) -> int:
        keys = await self.list(prefix)
        for k in keys:
            await self.delete(k)
        return len(keys)

    def remove_stale_temp_files(self, older_than_s: float, now: float | None = None) -> builtins.list[str]:
        """Temp files a killed writer left behind, older than the threshold; returns their names."""
        cutoff = (time.time() if now is None else now) - older_than_s
        removed = []
        for entry in os.scandir(self.tmp_dir):
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                removed.append(entry.name)
        return sorted(removed)
