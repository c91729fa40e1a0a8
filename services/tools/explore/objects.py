"""The simulated object store: keys to bytes in memory, under the ObjectStore contract (services/shell/objects/store.py)
that the local folder and S3 stores keep, so the archiver's own code writes its segments here and the history's own
reader reads them back. Checkpoints are not stored: the world records a commit as the uploader records one."""

import asyncio
import hashlib
from pathlib import Path

from flightdeck.services.shell.objects.store import ObjectAlreadyExists, ObjectNotFound, ObjectTooLarge, validate_key


class SimObjects:
    readback_after_put = False

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def uri(self, key: str) -> str:
        return f"sim:///{key}"

    async def put_file(self, key: str, path: Path) -> tuple[int, str]:
        data = await asyncio.to_thread(path.read_bytes)
        await self.put_bytes(key, data)
        return len(data), hashlib.sha256(data).hexdigest()

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        validate_key(key)
        if if_none_match and key in self.objects:
            raise ObjectAlreadyExists(f"{self.uri(key)} already exists")
        self.objects[key] = bytes(data)

    async def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        validate_key(key)
        if key not in self.objects:
            raise ObjectNotFound(f"{key!r} is not in the simulated store")
        data = self.objects[key]
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLarge(f"{key!r} holds {len(data)} bytes, more than {max_bytes}")
        return data

    async def get_file(self, key: str, path: Path) -> tuple[int, str]:
        data = await self.get_bytes(key)
        await asyncio.to_thread(path.write_bytes, data)
        return len(data), hashlib.sha256(data).hexdigest()

    async def hash_object(self, key: str, *, bytes_per_s: float = 0.0) -> tuple[int, str]:
        data = await self.get_bytes(key)
        return len(data), hashlib.sha256(data).hexdigest()

    async def exists(self, key: str) -> bool:
        return key in self.objects

    async def list(self, prefix: str) -> list[str]:
        return sorted(k for k in self.objects if k.startswith(prefix))

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    async def delete_prefix(self, prefix: str) -> int:
        gone = [k for k in self.objects if k.startswith(prefix)]
        for k in gone:
            del self.objects[k]
        return len(gone)
