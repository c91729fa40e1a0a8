"""The object-store surface the checkpoint service needs, its typed errors, and key validation.

Keys are built only from validated parts (`key(...)`), so no caller-supplied text — a job id, a
checkpoint id, a shard path announced by a rank — can climb out of its prefix. S3 stores keys with
`..` exactly as given (moto too), and a local store would resolve them, so we refuse them here.
"""

import hashlib
import time
import unicodedata
from pathlib import Path
from typing import Protocol, runtime_checkable

MAX_PART_BYTES = 255  # a file name on most filesystems
MAX_KEY_BYTES = 1024  # S3's limit
HASH_CHUNK = 1 << 20


class ObjectStoreError(Exception):
    """An object-store operation that failed in a way callers handle."""


class InvalidKey(ObjectStoreError, ValueError):
    """A key or key part that could escape its prefix or is not portable."""


class ObjectNotFound(ObjectStoreError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectAlreadyExists(ObjectStoreError):
    """A conditional create (`if_none_match`) found the key already written by someone else."""


class ObjectTooLarge(ObjectStoreError):
    """An object larger than its reader accepts (`get_bytes(max_bytes=...)`); no more of it than that was read."""


class UnsafeLocalPath(ObjectStoreError, ValueError):
    """A local path that resolves outside the directory it must stay in (e.g. through a symlink)."""


def validate_part(part: str) -> str:
    """One path segment: non-empty, not `.`/`..`, no slash, backslash, control or unprintable character."""
    if not isinstance(part, str) or part == "":
        raise InvalidKey("empty key part: keys are built from non-empty names (no '//', no leading or trailing '/')")
    if part in (".", ".."):
        raise InvalidKey(f"key part {part!r} is not allowed: keys never refer to '.' or '..'")
    for ch in part:
        if ch in "/\\":
            raise InvalidKey(f"key part {part!r} contains {ch!r}: pass parts separately, never with separators")
        if not ch.isprintable() and ch != " ":  # control, format, unassigned, surrogates, odd spaces
            name = unicodedata.category(ch)
            raise InvalidKey(f"key part {part!r} contains the control or unprintable character {ch!r} ({name})")
    if len(part.encode()) > MAX_PART_BYTES:
        raise InvalidKey(f"key part {part[:32]!r}... is longer than {MAX_PART_BYTES} bytes")
    return part


def split_relative(path: str) -> list[str]:
    """A relative slash-separated path (e.g. a shard path) as validated parts."""
    if path.startswith("/"):
        raise InvalidKey(f"path {path!r} must be relative: it starts with '/'")
    return [validate_part(p) for p in path.split("/")]


def key(*parts: str) -> str:
    """Join parts into a key; each part may be a relative path whose segments are validated."""
    if not parts:
        raise InvalidKey("a key needs at least one part")
    out = "/".join(seg for part in parts for seg in split_relative(part))
    if len(out.encode()) > MAX_KEY_BYTES:
        raise InvalidKey(f"key {out[:64]!r}... is longer than {MAX_KEY_BYTES} bytes")
    return out


def validate_key(k: str) -> str:
    """A whole key, as the stores accept it (the same rules as `key`)."""
    return key(k)


def validate_prefix(prefix: str) -> str:
    """A listing prefix: a valid key followed by '/' (or '' for everything)."""
    if prefix == "":
        return prefix
    if not prefix.endswith("/"):
        raise InvalidKey(f"prefix {prefix!r} must end with '/' so it cannot match a sibling ('a/b' would match 'a/bc')")
    validate_key(prefix[:-1])
    return prefix


def inside(root: Path, candidate: Path) -> Path:
    """`candidate` with symlinks resolved, or UnsafeLocalPath if that lands outside `root`."""
    real_root = root.resolve()
    real = candidate.resolve()
    if real != real_root and not real.is_relative_to(real_root):
        raise UnsafeLocalPath(f"{candidate} resolves to {real}, outside {real_root}")
    return real


def local_path(root: Path, relative: str) -> Path:
    """`root/relative` for a validated relative path, guaranteed (after symlinks) to stay inside root."""
    path = root.joinpath(*split_relative(relative))
    inside(root, path)
    return path


class Pace:
    """Keeps a reader at or under `bytes_per_s` on average (0: unbounded): after each chunk, wait `due(n)` seconds."""

    def __init__(self, bytes_per_s: float = 0.0) -> None:
        self.rate, self.start, self.done = bytes_per_s, time.monotonic(), 0

    def due(self, n: int) -> float:
        self.done += n
        return max(0.0, self.start + self.done / self.rate - time.monotonic()) if self.rate > 0 else 0.0


def hash_file(path: Path, bytes_per_s: float = 0.0) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks, at most `bytes_per_s` (0: as fast as the disk goes)."""
    digest, size, pace = hashlib.sha256(), 0, Pace(bytes_per_s)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if wait := pace.due(len(chunk)):
                time.sleep(wait)
    return size, digest.hexdigest()


@runtime_checkable
class ObjectStore(Protocol):
    """Where committed checkpoints live. Every key passes `validate_key`; every method is a coroutine."""

    # True where reading an object back is cheap (a local disk): the uploader then re-hashes what was stored.
    readback_after_put: bool

    def uri(self, key: str) -> str:
        """Where a key lives, for people and events: file:///... or s3://bucket/..."""

    async def put_file(self, key: str, path: Path) -> tuple[int, str]:
        """Upload a local file; returns (size, sha256) of the bytes that were sent."""

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        """Write small data; with `if_none_match`, raise ObjectAlreadyExists if the key exists."""

    async def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object, or ObjectNotFound; ObjectTooLarge if it holds more than `max_bytes`."""

    async def get_file(self, key: str, path: Path) -> tuple[int, str]:
        """Download to a local file (written atomically); returns (size, sha256) of what arrived."""

    async def hash_object(self, key: str, *, bytes_per_s: float = 0.0) -> tuple[int, str]:
        """(size, sha256) of the stored bytes, read back from the store at most `bytes_per_s` (0: unbounded)."""

    async def exists(self, key: str) -> bool:
        """Whether the key holds an object."""

    async def list(self, prefix: str) -> list[str]:
        """Keys under `prefix` (ending in '/'), sorted."""

    async def delete(self, key: str) -> None:
        """Remove a key; removing a missing key is not an error."""

    async def delete_prefix(self, prefix: str) -> int:
        """Remove every key under `prefix`; returns how many were removed."""
