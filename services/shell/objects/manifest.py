"""The checkpoint manifest, the key layout, and restore (read, verify, download).

    checkpoints/<job>/<checkpoint_id>/<shard path>
    checkpoints/<job>/<checkpoint_id>/MANIFEST.json     written last: a checkpoint without it does not exist

The manifest is JSON (people read it); its sha256 travels in CheckpointCommitted, so a restore can
tell the manifest it reads is the one that was committed. It is read whole into memory, so no manifest
larger than MAX_MANIFEST_BYTES is written or read: a hostile multi-GB one is refused before it is read.
"""

import asyncio
import hashlib
import shutil
import uuid
from pathlib import Path

import msgspec
import structlog

from flightdeck.events.checkpoint import DataPosition, ShardInfo
from flightdeck.events.codec import MAX_SLOTS
from flightdeck.services.shell.objects.store import (
    InvalidKey,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
    key,
    local_path,
    split_relative,
)

MANIFEST = "MANIFEST.json"
FORMAT = 1
DOWNLOAD_CONCURRENCY = 4
# The most shards a checkpoint has: one DCP file per rank (FileSystemWriter's default single thread) and the
# .metadata. A shard takes ~160 bytes of the indented JSON with DCP's names; 256 leaves room for longer ones,
# 64 KiB for the rest (data position, skip windows). About 16 MiB: what a 65,536-rank job's manifest needs.
MAX_SHARDS = MAX_SLOTS + 1
MAX_MANIFEST_BYTES = MAX_SHARDS * 256 + (64 << 10)

log = structlog.get_logger(__name__)


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: int = FORMAT
    job_id: str
    checkpoint_id: str
    step: int
    world_size: int
    attempt: int
    timeline: int = 0  # rollbacks the attempt had applied (lineage.py)
    created_at: float  # unix seconds, from the recorded event that completed the staging
    shards: list[ShardInfo]
    data: DataPosition

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self.shards)


class CheckpointMissing(LookupError):
    """No manifest under the checkpoint's prefix: the checkpoint was never committed (or was deleted)."""


class CorruptCheckpoint(ValueError):
    """A manifest or shard that does not match what was committed; never load it."""


def prefix(job_id: str, checkpoint_id: str) -> str:
    return key("checkpoints", job_id, checkpoint_id) + "/"


def shard_key(job_id: str, checkpoint_id: str, path: str) -> str:
    return key("checkpoints", job_id, checkpoint_id, path)


def manifest_key(job_id: str, checkpoint_id: str) -> str:
    return key("checkpoints", job_id, checkpoint_id, MANIFEST)


def check_shard_paths(shards: list[ShardInfo]) -> None:
    """Shard paths stay inside the checkpoint's prefix, are unique, and never shadow the manifest."""
    seen: set[str] = set()
    for shard in shards:
        try:
            split_relative(shard.path)
        except InvalidKey as exc:
            raise CorruptCheckpoint(f"shard path {shard.path!r} is not allowed: {exc}") from None
        if shard.path == MANIFEST:
            raise CorruptCheckpoint(f"a shard may not be called {MANIFEST}")
        if shard.path in seen:
            raise CorruptCheckpoint(f"shard path {shard.path!r} appears twice")
        if shard.size < 0 or len(shard.sha256) != 64:
            raise CorruptCheckpoint(f"shard {shard.path!r} has an impossible size or sha256")
        seen.add(shard.path)


def encode(manifest: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(data: bytes, *, job_id: str, checkpoint_id: str, expected_sha256: str = "") -> Manifest:
    """Parse and check a manifest read from `checkpoints/<job_id>/<checkpoint_id>/`."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpoint(f"manifest of {job_id}/{checkpoint_id} is {len(data)} bytes, more than the "
                                f"{MAX_MANIFEST_BYTES} any Flightdeck checkpoint needs")
    if expected_sha256 and sha256(data) != expected_sha256:
        raise CorruptCheckpoint(f"manifest of {job_id}/{checkpoint_id} has sha256 {sha256(data)}, "
                                f"but {expected_sha256} was committed")
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptCheckpoint(f"manifest of {job_id}/{checkpoint_id} is not valid: {exc}") from None
    if manifest.format > FORMAT:
        raise CorruptCheckpoint(f"manifest format {manifest.format} is newer than {FORMAT}; upgrade Flightdeck")
    if (manifest.job_id, manifest.checkpoint_id) != (job_id, checkpoint_id):
        raise CorruptCheckpoint(f"manifest under {job_id}/{checkpoint_id} names "
                                f"{manifest.job_id}/{manifest.checkpoint_id}")
    check_shard_paths(manifest.shards)
    return manifest


async def read_manifest(store: ObjectStore, job_id: str, checkpoint_id: str, *,
                        expected_sha256: str = "") -> tuple[Manifest, bytes]:
    try:
        data = await store.get_bytes(manifest_key(job_id, checkpoint_id), max_bytes=MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        raise CheckpointMissing(f"checkpoint {job_id}/{checkpoint_id} has no manifest: it was never committed "
                                "or has been deleted") from None
    except ObjectTooLarge as exc:
        raise CorruptCheckpoint(f"manifest of {job_id}/{checkpoint_id} refused unread: {exc}; no Flightdeck "
                                f"checkpoint needs more than {MAX_MANIFEST_BYTES} bytes") from None
    return decode(data, job_id=job_id, checkpoint_id=checkpoint_id, expected_sha256=expected_sha256), data


def verify_local(path: Path, *, job_id: str, checkpoint_id: str, expected_sha256: str = "") -> Manifest:
    """Check a downloaded copy again (a node's cache can rot, or be edited, after its verified download): its
    manifest against the committed hash, every shard's size and sha256 against the manifest."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError as exc:
        raise CorruptCheckpoint(f"cached copy of {job_id}/{checkpoint_id} has no readable manifest: {exc}") from None
    manifest = decode(raw, job_id=job_id, checkpoint_id=checkpoint_id, expected_sha256=expected_sha256)
    for shard in manifest.shards:
        f = local_path(path, shard.path)
        if not f.is_file():
            raise CorruptCheckpoint(f"cached copy of {job_id}/{checkpoint_id} lacks shard {shard.path!r}")
        digest, size = hashlib.sha256(), 0
        with f.open("rb") as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        if (size, digest.hexdigest()) != (shard.size, shard.sha256):
            raise CorruptCheckpoint(
                f"cached copy of {job_id}/{checkpoint_id}: shard {shard.path!r} has {size} bytes with sha256 "
                f"{digest.hexdigest()}, the manifest says {shard.size} bytes with {shard.sha256}")
    return manifest


def _partial_dir(dest: Path) -> Path:
    if dest.exists():
        raise FileExistsError(f"{dest} already exists: restore into a new folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.partial"
    tmp.mkdir()
    return tmp


def _finish(tmp: Path, dest: Path, raw: bytes) -> None:
    (tmp / MANIFEST).write_bytes(raw)
    tmp.rename(dest)


async def download(store: ObjectStore, job_id: str, checkpoint_id: str, dest: Path, *,
                   expected_sha256: str = "") -> Manifest:
    """Download a committed checkpoint into `dest` (which must not exist yet), verifying every shard.

    Files land in a sibling temp folder that is renamed to `dest` only when all of them match the
    manifest, so `dest` existing means a whole, verified checkpoint.
    """
    manifest, raw = await read_manifest(store, job_id, checkpoint_id, expected_sha256=expected_sha256)
    tmp = await asyncio.to_thread(_partial_dir, dest)
    slots = asyncio.Semaphore(DOWNLOAD_CONCURRENCY)
    errors: list[Exception] = []

    async def fetch(shard: ShardInfo) -> None:
        async with slots:
            if errors:  # the checkpoint is already refused: start no more downloads
                return
            try:
                size, digest = await store.get_file(shard_key(job_id, checkpoint_id, shard.path),
                                                    local_path(tmp, shard.path))
            except ObjectNotFound:
                errors.append(CorruptCheckpoint(f"shard {shard.path!r} of {job_id}/{checkpoint_id} is missing"))
                return
            except Exception as exc:
                errors.append(exc)
                return
        if (size, digest) != (shard.size, shard.sha256):
            errors.append(CorruptCheckpoint(
                f"shard {shard.path!r} of {job_id}/{checkpoint_id}: got {size} bytes with sha256 {digest}, "
                f"the manifest says {shard.size} bytes with {shard.sha256}"))

    try:
        # running downloads finish rather than being cancelled: a local store's copy runs in a thread
        # that a cancel would not stop, and it must not write into the folder after it is removed
        await asyncio.gather(*(fetch(shard) for shard in manifest.shards))
        if errors:
            raise next((e for e in errors if isinstance(e, CorruptCheckpoint)), errors[0])
        await asyncio.to_thread(_finish, tmp, dest, raw)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise
    log.info("checkpoint downloaded", job_id=job_id, checkpoint_id=checkpoint_id, bytes=manifest.bytes, dest=str(dest))
    return manifest
