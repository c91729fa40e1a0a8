"""Following one job: its control history and its telemetry, what is stored in time order and then each message
as it arrives, until the job ends (`flightdeck watch`, `submit --wait`, the demo, `events` and `logs --follow`). A
completed job's end includes its final checkpoint, which may be committed just after JobCompleted (waited for,
bounded)."""

import asyncio
import contextlib
import functools
import heapq
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from typing import Any, Protocol

from flightdeck.events import subjects
from flightdeck.events.admission import Admission
from flightdeck.events.base import JobEvent
from flightdeck.events.job import WorkersExited, WorkersStarted
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.tools.cli import EXIT_NOT_FOUND
from flightdeck.services.tools.client import ClientError
from flightdeck.services.tools.connect import open_store
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.jobview import JobView


class Sink(Protocol):
    view: JobView  # the job as its control history so far says; `view.ended` ends the follow

    def show(self, stored: Stored) -> None: ...


async def follow(url: str, job_id: str, sink: Sink, timeout_s: float | None) -> JobView:
    """Hand the job's events to `sink` until it ends; TimeoutError after `timeout_s` (None: never). What is stored
    already comes first, control and telemetry merged in time order (a job that has ended is told at once, its
    incidents in the order they happened), then each new message as it arrives."""
    admission = Admission()  # the sink's view folds what the services fold

    def show(stored: Stored) -> None:
        if stored.event is None or not admission.refusal(stored):
            sink.show(stored)

    async def go() -> None:
        async with open_store(url) as store:
            chosen = [(subjects.CONTROL, [subjects.job_all(job_id)]),
                      (subjects.TELEMETRY, [subjects.telemetry_job(job_id)])]
            stored = await read_all(store, chosen)
            if not any(s.stream == subjects.CONTROL for s in stored):
                raise ClientError(f"no job {job_id!r} on {url}: `flightdeck status` lists every job", EXIT_NOT_FOUND)
            for s in stored:
                show(s)
            if sink.view.ended and not sink.view.final_checkpoint_pending:
                return
            after = {stream: max((s.seq for s in stored if s.stream == stream), default=0) for stream, _ in chosen}
            await follow_all(store, chosen, after, show, ended(store, job_id))
    await asyncio.wait_for(go(), timeout_s)
    return sink.view


async def read_all(store: EventStore, chosen: Sequence[tuple[str, list[str]]]) -> list[Stored]:
    """Everything stored so far. Each stream stays in its own order (a job's history is its sequence, and
    a decision may carry an earlier time than events stored before it); the streams are interleaved by
    time, control first on ties."""
    per_stream: list[list[Stored]] = []
    for stream, filters in chosen:
        messages: list[Stored] = []
        async for batch in store.read(stream, filters):
            messages.extend(batch)
        per_stream.append(messages)
    return list(heapq.merge(*per_stream, key=occurred))


HOLD_S = 2.0  # the most a live control event waits for telemetry to reach its time (a quiet job's never does)


def occurred(stored: Stored) -> float:
    return stored.event.occurred_at if stored.event else 0.0


async def follow_all(
    store: EventStore, chosen: Sequence[tuple[str, list[str]]], after: dict[str, int], show: Callable[[Stored], None],
    until: Coroutine[Any, Any, object] | None = None,
) -> None:
    """Show new messages from every chosen stream as they arrive, until `until` returns (None: forever), and then
    what was stored before it did and not shown yet. A control event waits, at most HOLD_S, until the other
    streams have shown what happened before it: each stream has its own reader, and a crash's fault (telemetry)
    stored before the exit it caused (control) may reach its reader later."""
    shown = dict(after)
    reached = {stream: 0.0 for stream, _ in chosen}  # the newest time each stream has shown
    moved = asyncio.Condition()

    async def pump(stream: str, filters: list[str]) -> None:
        others = [other for other in reached if other != stream] if stream == subjects.CONTROL else []

        def caught_up(at: float) -> bool:
            return all(reached[other] >= at for other in others)

        async for stored in store.follow(stream, filters, from_seq=shown[stream] + 1):
            at = occurred(stored)
            if others:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(HOLD_S), moved:
                        await moved.wait_for(functools.partial(caught_up, at))
            shown[stream], reached[stream] = stored.seq, max(reached[stream], at)
            show(stored)
            async with moved:
                moved.notify_all()

    pumps = [asyncio.create_task(pump(stream, filters)) for stream, filters in chosen]
    try:
        if until is None:
            await asyncio.gather(*pumps)
            return
        waiting = asyncio.ensure_future(until)
        try:
            await asyncio.wait([waiting, *pumps], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():  # stopped, and its reader closed, before the pumps' error is told
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
        for task in pumps:
            if task.done():
                task.result()  # a pump ends only by failing: say why
        waiting.result()
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    rest = await read_all(store, chosen)  # stored before the end was seen, not yet pumped
    for stored in rest:
        if stored.seq > shown[stored.stream]:
            show(stored)


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
