"""Following one job live: its control history and its telemetry, each message handed to a sink as it arrives,
until the job ends (`flightdeck watch`, `submit --wait`, the demo). A completed job's end includes its final
checkpoint, which may be committed just after JobCompleted (`Client.events_stored` waits for it, bounded)."""

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Protocol

from flightdeck.events import subjects
from flightdeck.events.admission import Admission
from flightdeck.events.base import JobEvent
from flightdeck.events.job import WorkersExited, WorkersStarted
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.history import jobview
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


EXITS_WAIT_S = 30.0  # past a job's end, at most this long for its ranks' exit records (a lost node's never come)


async def ended(store: EventStore, job_id: str, *, exits: bool = False) -> JobView:
    """Return once the job's history says it ended, with its final checkpoint (bounded as `Client.events_stored`)
    and, with `exits`, the exit records of every rank it started (an agent records one after the rank's last output
    is stored), or EXITS_WAIT_S after the end without them. What `events --follow` and `logs --follow` stop on."""
    admission, view = Admission(), JobView(job_id=job_id)
    started: set[tuple[int, int]] = set()
    gone: set[tuple[int, int]] = set()
    ended_by: float | None = None  # the loop's time by which to stop waiting
    loop = asyncio.get_running_loop()
    messages = store.follow(subjects.CONTROL, [subjects.job_all(job_id)])
    try:
        while True:
            try:
                async with asyncio.timeout_at(ended_by):
                    stored = await anext(messages)
            except TimeoutError:
                return view
            if stored.event is None or not isinstance(stored.event, JobEvent) or admission.refusal(stored):
                continue
            event = stored.event
            view = jobview.evolve(view, event)
            if isinstance(event, WorkersStarted):
                started.update((event.attempt, rank) for rank in event.ranks)
            elif isinstance(event, WorkersExited):
                gone.update((event.attempt, x.rank) for x in event.exits())
            if not view.ended:
                continue
            owed = view.final_checkpoint_pending or (exits and not started <= gone)
            if not owed:
                return view
            if ended_by is None:
                ended_by = loop.time() + max(jobview.FINAL_WAIT_S if view.final_checkpoint_pending else 0.0,
                                             EXITS_WAIT_S if exits else 0.0)
    finally:
        if isinstance(messages, AsyncGenerator):
            await messages.aclose()  # its reader stops now, not when collected
