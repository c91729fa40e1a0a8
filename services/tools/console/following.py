"""Following one job live: its control history and its telemetry, each message handed to a sink as it arrives,
until the job ends (`flightdeck watch`, `submit --wait`, the demo). A completed job's end includes its final
checkpoint, which may be committed just after JobCompleted (`Client.events_stored` waits for it, bounded)."""

import asyncio
import contextlib
from typing import Protocol

from flightdeck.events.admission import Admission
from flightdeck.events.store import Stored
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.history.jobview import JobView


class Sink(Protocol):
    view: JobView  # the job as its control history so far says; `view.ended` ends the follow

    def show(self, stored: Stored) -> None: ...


async def follow(url: str, job_id: str, sink: Sink, timeout_s: float | None) -> JobView:
    """Hand the job's events to `sink` as they happen until it ends; TimeoutError after `timeout_s` (None: never)."""
    admission = Admission()  # the sink's view folds what the services fold

    async def pump() -> None:
        async with await Client.connect(url) as fd, contextlib.aclosing(fd.events_stored(job_id)) as events:
            async for stored in events:  # closed on a timeout too: its readers stop with it
                if stored.event is not None and admission.refusal(stored):
                    continue
                sink.show(stored)
                if sink.view.ended and not sink.view.final_checkpoint_pending:
                    return
    await asyncio.wait_for(pump(), timeout_s)
    return sink.view
