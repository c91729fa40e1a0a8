"""The web server behind `flightdeck ui`: it follows the event log and serves the live dashboard (`/`, pushed
updates on `/events` as server-sent events), `/metrics` (Prometheus) and `/healthz`; it binds to localhost unless
told otherwise. Without an operator token it is read-only. With one (`ui --operator-token-file`; `up` makes one),
`POST /api/jobs/<job>/<action>` carrying it (`Authorization: Bearer ...`) makes the client's call for a person
(services/tools/client.py: cancel, pause, resume, checkpoint, rollback), refused as the CLI refuses it.

Three loops feed it: one follow per stream (control, telemetry, logs, dead letters) folds every message into `Figures`,
resuming after its last sequence when the broker comes back; one reads each service's consumer lag; one re-runs
`postmortem`'s analysis of each job whose history moved (at most every ANALYSE_S per job), so incidents and goodput
are what `flightdeck postmortem` would say.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.jsreader import cancellable
from flightdeck.services.shell.connection import TRANSIENT
from flightdeck.services.shell.objects.open import objects_url
from flightdeck.services.shell.objects.open import open_store as open_objects
from flightdeck.services.shell.objects.store import ObjectStore
from flightdeck.services.shell.security.credentials import client_options
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.history.read import JobNotFound, job_rows
from flightdeck.services.tools.postmortem import Postmortem, analyse
from flightdeck.services.tools.web.actions import Actions
from flightdeck.services.tools.web.figures import Figures, IncidentRow, JobAnalysis
from flightdeck.services.tools.web.metrics import Live, exposition
from flightdeck.services.tools.web.page import snapshot

log = structlog.get_logger("flightdeck.web")
STREAMS = (subjects.CONTROL, subjects.TELEMETRY, subjects.LOGS, subjects.DEAD)
STATIC = Path(__file__).resolve().parent / "static"
PUSH_EVERY_S = 0.25  # a page gets at most this many updates a second, however fast events come
PING_S = 15.0  # an idle stream sends a comment this often, so proxies and the browser keep it open
LAG_S = 2.0
ANALYSE_S = 5.0  # a running job's postmortem figures are at most this much (plus one analysis) behind
RETRY_S = 1.0
EVIDENCE_SHOWN = 24  # events of an incident's causal chain the page lists
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Board:
    """Everything the server shows, and when each job was last analysed (monotonic seconds)."""

    figures: Figures = field(default_factory=Figures)
    live: Live = field(default_factory=Live)
    analysed_at: dict[str, float] = field(default_factory=dict)


class WebServer:
    def __init__(self, store: JetStreamStore, clock: Callable[[], float] = time.time, token: str | None = None,
                 url: str = "") -> None:
        self.store, self.board, self.clock = store, Board(), clock  # clock: the wall time event times are in
        self.actions = Actions(Client(store, url, producer="dashboard"), token)
        self.tasks: list[asyncio.Task[None]] = []
        self.moved = asyncio.Event()  # replaced and set whenever what a page shows may have changed
        self.analyses = 0
        self.closing = False  # the server is stopping: event streams end rather than hold its shutdown

    def touch(self) -> None:
        moved, self.moved = self.moved, asyncio.Event()
        moved.set()

    def start(self) -> None:
        self.tasks = [*(asyncio.create_task(self._follow(s)) for s in STREAMS),
                      asyncio.create_task(self._lag()), asyncio.create_task(self._analyse())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.index)
        app.router.add_get("/events", self.events)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_post("/api/jobs/{job}/{action}", self.actions.handle)
        app.router.add_static("/static", STATIC, follow_symlinks=False)
        return app

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a `board` snapshot now and after every change (at most every PUSH_EVERY_S), for the
        job named by `?job=` if any. The page never polls; the browser's EventSource reconnects by itself."""
        job_id = request.query.get("job") or None
        compare = tuple(j for j in request.query.get("compare", "").split(",") if j)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                             "X-Accel-Buffering": "no"})
        await stream.prepare(request)
        board, sent = self.board, None
        try:
            while not self.closing:
                moved = self.moved
                key = (board.figures.version, board.live.broker_up, self.analyses)
                if key != sent:
                    data = msgspec.json.encode(snapshot(board.figures, board.live, job_id, time.time(),
                                                        compare=compare, actions=self.actions.enabled))
                    await stream.write(b"event: board\ndata: " + data + b"\n\n")
                    sent = key
                try:
                    async with asyncio.timeout(PING_S):  # not wait_for: on 3.11 it can swallow a cancel
                        await moved.wait()
                except TimeoutError:
                    await stream.write(b": ping\n\n")
                if not self.closing:
                    await asyncio.sleep(PUSH_EVERY_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return stream

    async def metrics(self, request: web.Request) -> web.Response:
        body = exposition(self.board.figures, self.board.live, now=self.clock())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        up = self.board.live.broker_up
        return web.Response(status=200 if up else 503, text="ok\n" if up else "the broker is unreachable\n")

    async def _follow(self, stream: str) -> None:
        figures = self.board.figures
        while True:
            try:
                async for stored in self.store.follow(stream, from_seq=figures.positions.get(stream, 0) + 1):
                    figures.fold(stored)
                    if not self.moved.is_set():
                        self.touch()
            except TRANSIENT as exc:
                log.warning("web.follow_failed", stream=stream, error=repr(exc), retry_in_s=RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def _lag(self) -> None:
        live = self.board.live
        while True:
            was, live.broker_up = live.broker_up, self.store.nc.is_connected
            for name in subjects.SERVICES:
                try:
                    # cancellable: nats-py drops a cancel that races its answer, and stop() then waited forever
                    info = await cancellable(self.store.js.consumer_info(subjects.CONTROL, f"service-{name}"))
                    live.lag[name] = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
                except TRANSIENT:
                    live.broker_up = False
                    break
                except Exception:  # no such consumer: that service never started on this broker
                    live.lag.pop(name, None)
            if live.broker_up != was:
                self.touch()
            await asyncio.sleep(LAG_S)

    async def _analyse(self) -> None:
        """Each stale job's postmortem figures, from its whole history: archived segments (the object store the
        services use) and the streams."""
        async with contextlib.AsyncExitStack() as stack:
            objects: ObjectStore | None = None
            try:
                objects = await stack.enter_async_context(open_objects(objects_url()))
            except Exception as exc:  # figures from the streams alone, then
                log.warning("web.no_object_store", error=repr(exc))
            await self._analyse_with(objects)

    async def _analyse_with(self, objects: ObjectStore | None) -> None:
        board = self.board
        while True:
            now = time.monotonic()
            due = [(job_id, j) for job_id, j in list(board.figures.jobs.items())
                   if j.stale and now - board.analysed_at.get(job_id, -ANALYSE_S) >= ANALYSE_S]
            for job_id, job in due:
                seqs = (job.control_seq, job.telemetry_seq)  # what the rows read next hold at least
                try:
                    rows = await job_rows(self.store, job_id, objects=objects)
                    pm = await asyncio.to_thread(analyse, rows, job_id)
                except TRANSIENT as exc:
                    log.warning("web.analysis_failed", job=job_id, error=repr(exc))
                    break
                except (JobNotFound, LookupError):
                    board.analysed_at[job_id] = now
                    continue
                job.analysis = job_analysis(pm, *seqs)
                board.analysed_at[job_id] = now
                self.analyses += 1
                self.touch()
            await asyncio.sleep(0.5)


def job_analysis(pm: Postmortem, control_seq: int, telemetry_seq: int) -> JobAnalysis:
    """What the page shows of a job's postmortem analysis: its goodput, incidents and commit times."""
    return JobAnalysis(
        goodput=pm.goodput.goodput, parts=dict(pm.goodput.parts), control_seq=control_seq,
        telemetry_seq=telemetry_seq,
        rows=tuple(IncidentRow(number=i.number, kind=i.kind, trigger=i.trigger, attempt=i.attempt,
                               fault_s=i.fault_at, detect_s=i.time_to_detect, recover_s=i.time_to_recover,
                               decision=i.decision, resolution=i.resolution, diagnosis=i.diagnosis,
                               steps_redone=i.steps_redone,
                               evidence=tuple((m.at, m.type, m.detail)
                                              for m in (*i.chain, *i.related)[:EVIDENCE_SHOWN]))
                   for i in pm.incidents),
        commits=commit_seconds(pm))


def commit_seconds(pm: Postmortem) -> tuple[float, ...]:
    """Per committed checkpoint, from its last rank's CheckpointStaged (the rank's clock) to the commit's time as
    postmortem dates control events (stored no earlier than the newest clock tick before it)."""
    staged: dict[tuple[int, int, int], float] = {}
    for ev in pm.scan.staged:
        key = (ev.attempt, ev.step, ev.timeline)
        staged[key] = max(staged.get(key, 0.0), ev.occurred_at)
    return tuple(c.known - staged[key] for c in pm.scan.control if isinstance(c.event, CheckpointCommitted)
                 and (key := (c.event.attempt, c.event.step, c.event.timeline)) in staged)


async def serve(url: str, host: str, port: int, stop: asyncio.Event, *,
                ready: "asyncio.Future[int] | None" = None, clock: Callable[[], float] = time.time,
                token: str | None = None) -> None:
    """Run the server until `stop` is set. `ready` gets the port it listens on (useful with port 0); `clock` is what
    an ended job's series age by (metrics.ENDED_SERIES_S: a recorded history's test passes its own time)."""
    store = await JetStreamStore.connect(url, name="flightdeck-ui", provision=False, **client_options())
    server = WebServer(store, clock, token, url)
    server.start()
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        log.info("web.listening", url=f"http://{host}:{bound}", nats=url)
        if ready is not None:
            ready.set_result(bound)
        await stop.wait()
    finally:
        server.closing = True  # an open event stream held the shutdown until its next ping (30 s in a test)
        server.touch()
        await runner.cleanup()
        await server.stop()
        await store.close()
