"""Cleans up after writers that were killed mid-upload: S3 multipart uploads that were never completed
or aborted (their parts are stored, and billed, until someone aborts them) and local temp files."""

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime

import structlog

from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.s3 import S3Store
from flightdeck.services.shell.objects.store import ObjectStore

DEFAULT_OLDER_THAN_S = 6 * 3600.0  # far longer than any upload in progress takes

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Swept:
    key: str
    upload_id: str  # "" for a local temp file
    age_s: float


def _timestamp(value: datetime | str | float) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return float(value)


async def sweep_s3(store: S3Store, *, older_than_s: float = DEFAULT_OLDER_THAN_S,
                   now: float | None = None) -> list[Swept]:
    """Abort the store's multipart uploads initiated more than `older_than_s` ago."""
    now = time.time() if now is None else now
    swept = []
    for upload in await store.multipart_uploads():
        age = now - _timestamp(upload["Initiated"])
        if age < older_than_s or upload["UploadId"] in store.in_flight:
            continue  # may still be in progress in a live process
        await store.abort_upload(upload["Key"], upload["UploadId"])
        swept.append(Swept(key=upload["Key"], upload_id=upload["UploadId"], age_s=age))
        log.info("aborted dangling multipart upload", key=upload["Key"], upload_id=upload["UploadId"],
                 age_s=round(age, 1))
    return swept


async def sweep_local(store: LocalStore, *, older_than_s: float = DEFAULT_OLDER_THAN_S,
                      now: float | None = None) -> list[Swept]:
    """Remove the store's temp files older than `older_than_s`."""
    now = time.time() if now is None else now
    names = await asyncio.to_thread(store.remove_stale_temp_files, older_than_s, now)
    for name in names:
        log.info("removed stale temp file", name=name)
    return [Swept(key=name, upload_id="", age_s=older_than_s) for name in names]


async def sweep(store: ObjectStore, *, older_than_s: float = DEFAULT_OLDER_THAN_S,
                now: float | None = None) -> list[Swept]:
    """Sweep whichever kind of store this is."""
    if isinstance(store, S3Store):
        return await sweep_s3(store, older_than_s=older_than_s, now=now)
    if isinstance(store, LocalStore):
        return await sweep_local(store, older_than_s=older_than_s, now=now)
    raise TypeError(f"no sweeper for {type(store).__name__}")


async def run_periodically(store: ObjectStore, *, every_s: float = 3600.0,
                           older_than_s: float = DEFAULT_OLDER_THAN_S) -> None:
    """Sweep now and then every `every_s` seconds until cancelled; a failed sweep is logged and retried."""
    while True:
        try:
            await sweep(store, older_than_s=older_than_s)
        except Exception:
            log.error("sweep failed", store=repr(store), exc_info=True)
        await asyncio.sleep(every_s)
