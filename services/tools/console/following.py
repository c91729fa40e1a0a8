"""Following one job live: its control history and its telemetry, each message handed to a sink as it arrives,
until the job ends (`flightdeck watch`, `submit --wait`, the demo)."""

import asyncio
from typing import Any, Protocol

from events import subjects
from events.store import EventStore, Stored
from services.tools.connect import open_store
from services.tools.history.jobview import JobView

CANCEL_TRIES = 20  # an event reader of a busy stream may need several cancels to stop (see `stop`)


class Sink(Protocol):
    view: JobView  # the job as its control history so far says; `view.ended` ends the follow

    def show(self, stored: Stored) -> None: ...


async def follow(url: str, job_id: str, sink: Sink, timeout_s: float | None) -> JobView:
    """Hand the job's events to `sink` as they happen until it ends; TimeoutError after `timeout_s` (None: never)."""
    ended = asyncio.Event()

    def show(stored: Stored) -> None:
        sink.show(stored)
        if sink.view.ended:
            ended.set()

    async def pump(store: EventStore, stream: str, filters: list[str]) -> None:
        async for stored in store.follow(stream, filters):
            show(stored)

    async with open_store(url) as store:
        readers = [asyncio.create_task(pump(store, subjects.CONTROL, [subjects.job_all(job_id)])),
                   asyncio.create_task(pump(store, subjects.TELEMETRY, [subjects.telemetry_job(job_id)]))]
        waiter = asyncio.create_task(ended.wait())
        try:
            await asyncio.wait({*readers, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            for reader in readers:
                if reader.done():
                    reader.result()  # a reader failed: say why
            if not ended.is_set():
                raise TimeoutError
        finally:
            await stop([*readers, waiter])
    return sink.view


async def stop(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` until every one has stopped. Once is not always enough on Python 3.11: its
    asyncio.wait_for, which the store's readers wait in, drops a cancel that lands just as the wait it
    guards completes (gh-86296), and a reader of a busy stream then reads on forever."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(CANCEL_TRIES):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    raise RuntimeError(f"{len(pending)} event readers ignored {CANCEL_TRIES} cancels")
