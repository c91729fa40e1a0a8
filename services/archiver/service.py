"""The archiver as a running service: its pure core (core.py) bound to the event store it reads the streams from
and the object store it writes segments to.

Why it works this way: docs/internals.md, "9. The whole history".
"""

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import structlog

from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.archiver.core import (
    ARCHIVE,
    FINAL_QUIET_S,
    FINAL_READ_MAX_S,
    Ask,
    Settings,
    State,
    core_service,
)
from flightdeck.services.core import Emit, Service
from flightdeck.services.shell.objects import segments
from flightdeck.services.shell.objects.open import objects_url, open_store
from flightdeck.services.shell.objects.store import ObjectStore

log = structlog.get_logger("flightdeck.archiver")

EVERY_ENV = "FLIGHTDECK_ARCHIVE_EVERY_S"
_POLL_S = 0.5  # how often a final segment's read looks for more of the job's messages


async def archive(events: EventStore, objects: ObjectStore, ask: Ask, *, quiet_s: float = FINAL_QUIET_S,
                  wait_max_s: float = FINAL_READ_MAX_S) -> list[Emit]:
    """Read the job's messages in `ask.stream` from `ask.from_seq` to the stream's end (a final segment: until
    they have stopped coming for `quiet_s`, at most `wait_max_s`: an agent may store a rank's last events after
    its exit record when the broker is slow, and reports the final checkpoint's upload after it), store them as
    one segment and return its record; nothing when there is nothing new to say (no message, nothing lost, not
    final)."""
    first, first_at, last = await events.bounds(ask.stream)
    lost_from = lost_to = 0
    if ask.from_seq == 0 and first > 1 and first_at > ask.submitted_at:
        lost_from, lost_to = 0, first - 1  # the stream's oldest message is younger than the job: some may be gone
    elif 0 < ask.from_seq < first:
        lost_from, lost_to = ask.from_seq, first - 1
    start = max(ask.from_seq, first, 1)
    rows = await _read(events, ask, start, last)
    if ask.final:
        last = await _settle(events, ask, last, rows, quiet_s, wait_max_s)
    if not rows and not lost_to and not ask.final:
        return []
    first_seq = max(ask.from_seq, 1)
    last_seq = max(last, first_seq - 1)
    seg = segments.Segment(job_id=ask.job_id, stream=ask.stream, first_seq=first_seq, last_seq=last_seq,
                           messages=[segments.Message(r.seq, r.subject, r.data, r.msg_id) for r in rows])
    data, sha = segments.encode(seg)
    key = segments.key(ask.job_id, ask.stream, first_seq, last_seq)
    await objects.put_bytes(key, data)
    log.info("segment archived", job_id=ask.job_id, stream=ask.stream, first_seq=first_seq, last_seq=last_seq,
             count=len(rows), bytes=len(data), lost_to=lost_to, final=ask.final)
    record = HistoryArchived(job_id=ask.job_id, stream=ask.stream, first_seq=first_seq, last_seq=last_seq,
                             count=len(rows), bytes=len(data), sha256=sha, key=key, lost_from=lost_from,
                             lost_to=lost_to, final=ask.final)
    return [Emit(subjects.job(ask.job_id, "HistoryArchived"), record)]


async def _read(events: EventStore, ask: Ask, start: int, last: int) -> list[Stored]:
    rows: list[Stored] = []
    if last >= start:
        async for batch in events.read(ask.stream, [segments.job_filter(ask.job_id, ask.stream)], from_seq=start,
                                       until_seq=last):
            rows += batch
    return rows


async def _settle(events: EventStore, ask: Ask, last: int, rows: list[Stored], quiet_s: float,
                  wait_max_s: float) -> int:
    """Read on (into `rows`) while the job's messages keep coming; the last sequence read."""
    loop = asyncio.get_running_loop()
    began = quiet_since = loop.time()
    while loop.time() - quiet_since < quiet_s:
        if loop.time() - began >= wait_max_s:
            log.warning("final segment taken while the job's messages still come", job_id=ask.job_id,
                        stream=ask.stream, waited_s=wait_max_s)
            break
        await asyncio.sleep(min(_POLL_S, quiet_s))
        _, _, end = await events.bounds(ask.stream)
        more = await _read(events, ask, last + 1, end)
        last = max(last, end)
        if more:
            rows += more
            quiet_since = loop.time()
    return last


class _Stores:
    """The object store, opened the first time a segment is written; the event store, handed over by the shell."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: EventStore | None = None
        self._stack = contextlib.AsyncExitStack()
        self._objects: ObjectStore | None = None

    def bind(self, store: EventStore) -> None:
        self.events = store

    async def run(self, args: Any) -> list[Emit]:
        if self.events is None:
            raise RuntimeError("the archiver's effect ran before the shell handed it the event store")
        if self._objects is None:
            self._objects = await self._stack.enter_async_context(open_store(self.url))
        return await archive(self.events, self._objects, args)


def build(env: Mapping[str, str] | None = None) -> Service[State]:
    env = os.environ if env is None else env
    stores = _Stores(objects_url(env))
    every_s = float(env.get(EVERY_ENV) or Settings().every_s)
    return core_service({ARCHIVE: stores.run}, every_s=every_s, tick_s=min(5.0, every_s), bind=stores.bind)
