"""An S3-compatible object store through aioboto3.

Large files go up as multipart uploads: parts are read and hashed in order, and uploaded with a
bound on parts in flight that is shared by every file of the store (so memory stays at most
`max_concurrency * part_size`). A multipart upload that fails in this process is aborted; one left
by a killed process is the sweeper's job. Credentials come only from the standard AWS chain (env,
profile, instance role); they are never passed through here or logged. `endpoint_url=None` lets
botocore read `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` as usual.
"""

import asyncio
import builtins
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from flightdeck.services.shell.objects.retry import RetryPolicy, error_code
from flightdeck.services.shell.objects.store import (
    HASH_CHUNK,
    ObjectAlreadyExists,
    ObjectNotFound,
    ObjectTooLarge,
    Pace,
    validate_key,
    validate_prefix,
)

MiB = 1 << 20
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3 refuses smaller parts (except the last)
MAX_PARTS = 10_000
PROGRESS_EVERY_S = 2.0
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # botocore's default
MIN_THROUGHPUT = 1 * MiB  # bytes/s below which one request's body counts as stalled

log = structlog.get_logger(__name__)


def _read_part(fd: int, offset: int, length: int, digest: Any) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(f"file shrank while uploading: wanted {length} bytes at {offset}, read {len(data)}")
    digest.update(data)  # parts are read in order, so the whole-file hash comes out right
    return data


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _first_error(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class S3Store:
    """An ObjectStore over one bucket (and an optional root prefix inside it)."""

    readback_after_put = False  # reading back doubles the traffic; sha256 is computed on the bytes sent

    def __init__(self, client: Any, bucket: str, *, root: str = "", part_size: int = DEFAULT_PART_SIZE,
                 max_concurrency: int = 8, retry: RetryPolicy | None = None,
                 try_timeout_s: float | None = None) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size {part_size} is below S3's minimum of {MIN_PART_SIZE} bytes (5 MiB)")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.client = client
        self.bucket = bucket
        self.root = validate_prefix(root)
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.retry = retry or RetryPolicy()
        # the longest one API call may take, its body included
        self.try_timeout_s = try_timeout_s or CONNECT_TIMEOUT_S + READ_TIMEOUT_S + part_size / MIN_THROUGHPUT
        self._slots = asyncio.Semaphore(max_concurrency)
        self.in_flight: set[str] = set()  # multipart upload ids this store is running (the sweeper skips them)

    @classmethod
    @asynccontextmanager
    async def open(cls, bucket: str, *, root: str = "", endpoint_url: str | None = None,
                   region_name: str | None = None, part_size: int = DEFAULT_PART_SIZE, max_concurrency: int = 8,
                   retry: RetryPolicy | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                   read_timeout_s: float = READ_TIMEOUT_S, try_timeout_s: float | None = None,
                   ) -> AsyncIterator["S3Store"]:
        """A store with one client for its lifetime (connections are pooled per client). An endpoint that
        stops answering costs at most `try_timeout_s` per call (default: both timeouts plus a part's transfer
        at MIN_THROUGHPUT); RetryPolicy bounds the tries and their total time."""
        # Imported here, not at the top: aioboto3 and botocore cost every process that opens the store module
        # about 0.2 CPU-s, and most never open an S3 store (the local one is the default).
        import aioboto3
        from aiobotocore.config import AioConfig

        config = AioConfig(max_pool_connections=max(10, 2 * max_concurrency),
                           connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                           retries={"total_max_attempts": 1})  # RetryPolicy is the one retry layer
        session = aioboto3.Session()
        async with session.client("s3", endpoint_url=endpoint_url, region_name=region_name, config=config) as client:
            yield cls(client, bucket, root=root, part_size=part_size, max_concurrency=max_concurrency, retry=retry,
                      try_timeout_s=try_timeout_s or connect_timeout_s + read_timeout_s + part_size / MIN_THROUGHPUT)

    def __repr__(self) -> str:
        return f"S3Store({self.uri('')!r})"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.root}{key}"

    def _k(self, key: str) -> str:
        return self.root + validate_key(key)

    async def _call(self, op: str, **kwargs: Any) -> Any:
        method = getattr(self.client, op)

        async def once() -> Any:
            # The read timeout does not cover a PUT's `Expect: 100-continue`: aiohttp waits for the 100 without
            # one, so an endpoint that accepts the connection and never answers held a commit forever.
            async with asyncio.timeout(self.try_timeout_s):
                return await method(Bucket=self.bucket, **kwargs)

        return await self.retry.call(op, once)

    async def put_file(self, key: str, path: Path) -> tuple[int, str]:
        k = self._k(key)
        size = os.stat(path).st_size
        if size <= self.part_size:
            data = await asyncio.to_thread(path.read_bytes)
            await self._call("put_object", Key=k, Body=data)
            return len(data), hashlib.sha256(data).hexdigest()
        return await self._multipart(k, path, size)

    def _part_size_for(self, size: int) -> int:
        return max(self.part_size, -(-size // MAX_PARTS))

    async def _multipart(self, k: str, path: Path, size: int) -> tuple[int, str]:
        part_size = self._part_size_for(size)
        upload_id = (await self._call("create_multipart_upload", Key=k))["UploadId"]
        self.in_flight.add(upload_id)
        blog = log.bind(key=k, bytes=size, parts=-(-size // part_size), upload_id=upload_id)
        digest = hashlib.sha256()
        etags: dict[int, str] = {}
        sent = [0, time.monotonic()]  # bytes sent, time of the last progress line
        started = time.monotonic()

        async def upload(number: int, data: bytes) -> None:
            try:
                resp = await self._call("upload_part", Key=k, UploadId=upload_id, PartNumber=number, Body=data)
                etags[number] = resp["ETag"]
            finally:
                self._slots.release()
            sent[0] += len(data)
            now = time.monotonic()
            if now - sent[1] >= PROGRESS_EVERY_S:
                sent[1] = now
                blog.info("upload progress", sent=sent[0], mb_s=round(sent[0] / MiB / (now - started), 1))

        fd = os.open(path, os.O_RDONLY)
        try:
            async with asyncio.TaskGroup() as tg:
                for number, offset in enumerate(range(0, size, part_size), start=1):
                    await self._slots.acquire()  # shared by all files: bounds memory and requests in flight
                    try:
                        data = await asyncio.to_thread(_read_part, fd, offset, min(part_size, size - offset), digest)
                    except BaseException:
                        self._slots.release()
                        raise
                    tg.create_task(upload(number, data))
            parts = [{"ETag": etags[n], "PartNumber": n} for n in sorted(etags)]
            await self._call("complete_multipart_upload", Key=k, UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException as exc:
            await asyncio.shield(self._abort(k, upload_id))
            if isinstance(exc, BaseExceptionGroup):
                raise _first_error(exc) from None
            raise
        finally:
            os.close(fd)
            self.in_flight.discard(upload_id)
            await asyncio.shield(self._abort_orphans(k))
        seconds = time.monotonic() - started
        blog.info("uploaded", seconds=round(seconds, 3), mb_s=round(size / MiB / max(seconds, 1e-9), 1))
        return size, digest.hexdigest()

    async def _abort_orphans(self, k: str) -> None:
        """Abort other open uploads of key `k`: a CreateMultipartUpload that timed out may have started one whose id
        never reached us, and the retry started another (seen with moto on a loaded box)."""
        try:
            listed = await self._call("list_multipart_uploads", Prefix=k)
        except Exception as exc:  # the sweeper aborts what stays; the upload itself is done
            log.error("could not list open uploads", key=k, error=repr(exc))
            return
        for upload in listed.get("Uploads", []):
            if upload.get("Key") == k and upload["UploadId"] not in self.in_flight:
                await self._abort(k, upload["UploadId"])

    async def _abort(self, k: str, upload_id: str) -> None:
        try:
            await self._call("abort_multipart_upload", Key=k, UploadId=upload_id)
            log.warning("multipart upload aborted", key=k, upload_id=upload_id)
        except Exception as exc:  # the sweeper aborts it later; the original error matters more
            log.error("could not abort multipart upload", key=k, upload_id=upload_id, error=repr(exc))

    async def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            await self._call("put_object", Key=self._k(key), Body=data, **extra)
        except Exception as exc:
            if error_code(exc)[0] == "PreconditionFailed" or error_code(exc)[1] == 412:
                raise ObjectAlreadyExists(f"{self.uri(key)} already exists") from None
            raise

    async def _get(self, key: str) -> Any:
        """GetObject without retries: callers retry the whole read, body included."""
        try:
            return await self.client.get_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as exc:
            if error_code(exc)[0] in ("NoSuchKey", "404") or error_code(exc)[1] == 404:
                raise ObjectNotFound(f"{self.uri(key)} does not exist") from None
            raise

    async def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        def too_large(size: int) -> ObjectTooLarge:
            return ObjectTooLarge(f"{self.uri(key)} holds {size} bytes, more than the {max_bytes} its reader accepts")

        async def read() -> bytes:
            resp = await self._get(key)
            body = resp["Body"]
            async with body:  # the wrapper's __aenter__ returns the raw response; read through the wrapper
                if max_bytes is None:
                    return bytes(await body.read())
                if int(resp.get("ContentLength", 0)) > max_bytes:
                    raise too_large(int(resp["ContentLength"]))  # the body is dropped unread
                chunks, got = [], 0
                async for chunk in body.iter_chunks(HASH_CHUNK):  # and a body longer than announced is cut off
                    got += len(chunk)
                    if got > max_bytes:
                        raise too_large(got)
                    chunks.append(chunk)
                return b"".join(chunks)

        return await self.retry.call("get_bytes", read)

    async def _stream(self, key: str, sink: Any) -> tuple[int, str]:
        """Read an object in chunks into `sink(chunk)`; returns (size, sha256). Retried as a whole."""
        digest, size = hashlib.sha256(), 0
        resp = await self._get(key)
        body = resp["Body"]
        async with body:
            async for chunk in body.iter_chunks(HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                await sink(chunk)
        return size, digest.hexdigest()

    async def get_file(self, key: str, path: Path) -> tuple[int, str]:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")

        async def download() -> tuple[int, str]:
            f = await asyncio.to_thread(open, tmp, "wb")
            try:
                result = await self._stream(key, lambda chunk: asyncio.to_thread(f.write, chunk))
                await asyncio.to_thread(_sync, f)
            finally:
                f.close()
            return result

        try:
            result = await self.retry.call("get_file", download)
            os.replace(tmp, path)
            return result
        finally:
            tmp.unlink(missing_ok=True)

    async def hash_object(self, key: str, *, bytes_per_s: float = 0.0) -> tuple[int, str]:
        async def read() -> tuple[int, str]:
            pace = Pace(bytes_per_s)

            async def paced(chunk: bytes) -> None:
                if wait := pace.due(len(chunk)):
                    await asyncio.sleep(wait)

            return await self._stream(key, paced)

        return await self.retry.call("hash_object", read)

    async def exists(self, key: str) -> bool:
        try:
            await self._call("head_object", Key=self._k(key))
        except Exception as exc:
            if error_code(exc)[1] == 404 or error_code(exc)[0] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    async def list(self, prefix: str) -> list[str]:
        full = self.root + validate_prefix(prefix)

        async def collect() -> list[str]:
            keys: list[str] = []
            async for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][len(self.root):] for obj in page.get("Contents", []))
            return keys

        return sorted(await self.retry.call("list_objects_v2", collect))

    async def delete(self, key: str) -> None:
        await self._call("delete_object", Key=self._k(key))

    async def delete_prefix(self, prefix: str) -> int:
        keys = await self.list(prefix)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self.root + k} for k in keys[i:i + 1000]]
            resp = await self._call("delete_objects", Delete={"Objects": batch, "Quiet": True})
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise OSError(f"could not delete {len(resp['Errors'])} objects, e.g. {first.get('Key')}: "
                              f"{first.get('Code')} {first.get('Message')}")
        return len(keys)

    async def multipart_uploads(self) -> builtins.list[dict[str, Any]]:
        """Unfinished multipart uploads under this store's root (what the sweeper inspects)."""
        async def collect() -> builtins.list[dict[str, Any]]:
            out: builtins.list[dict[str, Any]] = []
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.root)
            async for page in pages:
                out.extend(page.get("Uploads", []))
            return out

        return await self.retry.call("list_multipart_uploads", collect)

    async def abort_upload(self, key: str, upload_id: str) -> None:
        await self._call("abort_multipart_upload", Key=key, UploadId=upload_id)
