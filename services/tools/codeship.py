"""Shipping a job's code with it: `flightdeck submit` packs the job's folder (services/shell/objects/code.py),
stores the archive in the platform's object store under its sha256, and records that address in the spec
(`entrypoint.code`), so every node agent runs the same bytes without anything copied by hand.

A job ships its folder unless its spec names code already on the nodes (an absolute `entrypoint.cwd`), it has no
entrypoint (the built-in trainer), or it was shipped already. Where the object store is: console/submit.py.
"""

import asyncio
import os
from pathlib import Path

import msgspec
import structlog

from flightdeck.events.spec import JobSpec
from flightdeck.services.shell.objects import code
from flightdeck.services.shell.objects.store import ObjectStore

log = structlog.get_logger("flightdeck.submit")


def ships(spec: JobSpec) -> bool:
    """Whether submitting `spec` ships a folder with it."""
    entry = spec.entrypoint
    return entry is not None and not entry.code and not os.path.isabs(entry.cwd)


async def ship(spec: JobSpec, folder: Path, objects: ObjectStore) -> JobSpec:
    """`spec` with its folder shipped: the archive stored (once: the same bytes have the same key) and its
    address recorded in `entrypoint.code`. A spec that ships nothing (`ships`) comes back as it is."""
    if not ships(spec):
        return spec
    packed = await asyncio.to_thread(code.pack, folder)
    if not await objects.exists(packed.key):
        await objects.put_bytes(packed.key, packed.data)
    log.info("code shipped", folder=str(folder), address=packed.address, files=packed.files,
             mb=round(packed.size / 1e6, 2), archive_mb=round(len(packed.data) / 1e6, 2))
    assert spec.entrypoint is not None
    entry = msgspec.structs.replace(spec.entrypoint, code=packed.address, code_bytes=len(packed.data))
    return msgspec.structs.replace(spec, entrypoint=entry)
