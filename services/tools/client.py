"""The Python client of a Flightdeck platform, for automation (also `flightdeck.client`). The CLI's verbs are
built on it: what `flightdeck submit|status|cancel|pause|resume|checkpoint|watch` do, a script does with it.

    async with await Client.connect("nats://127.0.0.1:4222") as fd:
        job = await fd.submit(spec)                       # a JobSpec, or a TOML spec file's path
        async for event in fd.events(job):                # typed catalog events (events/), as they happen
            ...                                           # until the job ends
        view = await fd.wait(job)                         # or just wait: a JobView (phase, step, restarts, ...)
        async for stored in fd.follow([JobFailed]):       # every job's, live (examples/webhook_notifier)
            page_someone(stored.event)                    # keep stored.seq to resume there after a restart

Every method is a coroutine; errors a person can act on (no broker, no such job, a job not in a phase that takes
the command) raise `ClientError` with a one-line message. Nothing here imports torch.
"""

import asyncio
import contextlib
import secrets
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Collection
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import msgspec

from flightdeck.events import subjects
from flightdeck.events.admission import Admission, admitted_events
from flightdeck.events.base import Event, JobEvent, NodeEvent, RankEvent
from flightdeck.events.commands import CheckpointRequested, PauseRequested, ResumeRequested
from flightdeck.events.history import HistoryGap, append_to_job, check_contiguous, read_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import CancelRequested, CheckpointAdopted, JobSubmitted, RollbackAsked
from flightdeck.events.spec import MAX_SPEC_BYTES, InvalidSpec, JobSpec, check, parse_spec
from flightdeck.events.store import EventStore, Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.cli import EXIT_ERROR, EXIT_INVALID, EXIT_NOT_FOUND, UserError
from flightdeck.services.tools.connect import connect
from flightdeck.services.tools.history import adoption, jobview
from flightdeck.services.tools.history.jobview import ENDED, JobView

ClientError = UserError  # one message, and the exit code the CLI would use
ID_TRIES = 8
Command = CheckpointRequested | PauseRequested | ResumeRequested
E = TypeVar("E", bound=Event)


class Client:
    """A connection to one platform's broker. `Client.connect(url)` (default: $FLIGHTDECK_NATS_URL, else the
    local default); use it as an async context manager, or call `close()`."""

    def __init__(self, store: EventStore, url: str, *, producer: str = "cli") -> None:
        self.store, self.url, self.producer = store, url, producer

    @classmethod
    async def connect(cls, url: str | None = None, *, producer: str = "cli") -> "Client":
        resolved = nats_url(url)
        return cls(await connect(resolved), resolved, producer=producer)

    async def close(self) -> None:
        if isinstance(self.store, JetStreamStore):
            await self.store.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- jobs ------------------------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec | str | Path, *, now: float | None = None) -> str:
        """Append JobSubmitted under a job id no history uses yet (`<name>-<6 hex>`); returns that id. A spec that
        starts from another job's checkpoint (`init_from`) has it resolved first (services/tools/adoption.py), and
        that job's history records the adoption (CheckpointAdopted)."""
        if not isinstance(spec, JobSpec):
            spec = read_spec(Path(spec))
        if (init := spec.init_from) is not None and not init.checkpoint_id:
            check_job_id(init.job)
            init = adoption.resolved(init, await self.status(init.job), await self.history(init.job))
            spec = msgspec.structs.replace(spec, init_from=init)
        try:
            spec = check(spec)  # what every reader checks: a spec no rank could run would be dead-lettered
        except InvalidSpec as exc:
            raise ClientError(f"job spec {spec.name!r}: {exc}", EXIT_INVALID) from None
        for _ in range(ID_TRIES):
            job_id = f"{spec.name}-{secrets.token_hex(3)}"
            if await self.store.last(subjects.CONTROL, subjects.job_all(job_id)) is None:
                break
        else:
            raise ClientError(f"no unused job id for {spec.name!r} after {ID_TRIES} tries: is the store full of them?")
        await append_to_job(self.store, self._stamped(JobSubmitted(job_id=job_id, spec=spec), now))
        if (init := spec.init_from) is not None:
            await append_to_job(self.store, self._stamped(CheckpointAdopted(
                job_id=init.job, by_job=job_id, checkpoint_id=init.checkpoint_id, step=init.checkpoint_step,
                what=init.what), now))
        return job_id

    async def resume_from(self, job_id: str, *, now: float | None = None) -> str:
        """Submit a new job that continues ended job `job_id` from its newest good checkpoint (`submit
        --resume-from`): its own spec, model, optimizer, data position and step; returns the new job's id."""
        check_job_id(job_id)
        return await self.submit(adoption.continuing(job_id, await self.history(job_id)), now=now)

    async def status(self, job_id: str) -> JobView:
        """The job as its history says now (phase, step and loss, restarts, checkpoints, why it waits or ended)."""
        check_job_id(job_id)
        history = await self.history_stored(job_id)
        if not history:
            raise ClientError(f"no job {job_id!r} on {self.url}: `flightdeck status` lists every job", EXIT_NOT_FOUND)
        return jobview.fold(job_id, _events(history), await self._newest_step(job_id))

    async def jobs(self, *, warn: Callable[[str], object] = lambda line: print(line, file=sys.stderr)
                   ) -> list[JobView]:
        """Every job, oldest submission first. Subjects that hold no readable submission (dead-lettered junk)
        are left out, and `warn` is told so."""
        per_job: dict[str, list[Stored]] = defaultdict(list)
        async for batch in self.store.read(subjects.CONTROL, ["fd.ctl.job.>"]):
            for stored in batch:
                job_id = subjects.job_of(stored.subject)
                if job_id is not None:
                    per_job[job_id].append(stored)
        views, junk = [], []
        for job_id, history in per_job.items():
            events = _events(history)
            if not any(isinstance(e, JobSubmitted) for e in events):
                junk.append(job_id)
                continue
            try:
                check_contiguous(job_id, history)
            except HistoryGap as exc:
                warn(f"flightdeck status: warning: {exc}")
            views.append(jobview.fold(job_id, events, await self._newest_step(job_id)))
        if junk:
            warn(f"flightdeck status: {len(junk)} job subject(s) with no readable submission left out "
                 f"({', '.join(sorted(junk)[:5])}{', ...' if len(junk) > 5 else ''}); "
                 "`flightdeck events` shows what is there")
        return sorted(views, key=lambda v: (v.submitted_at, v.job_id))

    async def cancel(self, job_id: str, reason: str = "") -> JobView:
        """Ask for the job to be cancelled (its ranks are stopped, it ends as cancelled); a job that has ended, or
        whose cancel is already asked for, is left as it is. Returns the view it was sent against."""
        view = await self.status(job_id)
        if not view.ended and not view.cancel_requested:
            cancel = CancelRequested(job_id=job_id, reason=reason or "cancelled by the user")
            await append_to_job(self.store, self._stamped(cancel))
        return view

    async def pause(self, job_id: str, reason: str = "") -> None:
        """The running job's ranks stop stepping at their next step boundary (hang detection pauses too); a paused
        job is refused."""
        await self._command(job_id, PauseRequested(job_id=job_id, reason=reason or "pause"), ("running",))

    async def resume(self, job_id: str, reason: str = "") -> None:
        """A paused job's ranks step on; a job that is not paused is refused."""
        await self._command(job_id, ResumeRequested(job_id=job_id, reason=reason or "resume"), ("paused",))

    async def checkpoint(self, job_id: str, reason: str = "") -> None:
        """The job's ranks checkpoint at their next step boundary, all at the same step (paused ranks too)."""
        await self._command(job_id, CheckpointRequested(job_id=job_id, reason=reason or "checkpoint"),
                            ("running", "paused"))

    async def rollback(self, job_id: str, to_step: int, *, skip: tuple[int, int] | None = None,
                       reason: str = "") -> str:
        """Ask the scheduler to roll the running job back to its newest checkpoint at or before `to_step`, its
        ranks then skipping the batch window `skip` = (from, to); returns that checkpoint's id. The scheduler
        records the RollbackRequested (in flight until the ranks report RolledBack)."""
        skip_from, skip_to = skip if skip is not None else (0, 0)
        if skip is not None and not 0 <= skip_from < skip_to:
            raise ClientError(f"a skip window is FROM:TO batch indices with 0 <= FROM < TO, not {skip_from}:{skip_to}",
                              EXIT_INVALID)
        view = await self.status(job_id)
        if view.phase not in ("running", "paused"):
            raise ClientError(f"{job_id} is {view.phase}: only a running job rolls back; nothing sent", EXIT_ERROR)
        good = [c for c in view.checkpoints if not c.deleted and not c.bad and c.step <= to_step]
        if not good:
            have = ", ".join(str(c.step) for c in view.checkpoints if not c.deleted and not c.bad) or "none"
            raise ClientError(f"{job_id} has no committed checkpoint at or before step {to_step} (steps: {have}); "
                              "nothing sent", EXIT_ERROR)
        await append_to_job(self.store, self._stamped(RollbackAsked(job_id=job_id, to_step=to_step,
                                                                    skip_from=skip_from, skip_to=skip_to,
                                                                    reason=reason)))
        return max(good, key=lambda c: (c.step, c.committed_at)).checkpoint_id

    # -- history and live events ----------------------------------------------------------------------------

    async def history(self, job_id: str) -> list[Event]:
        """The job's control history as typed events, in order (an event too new for this code is left out)."""
        return _events(await self.history_stored(job_id))

    async def history_stored(self, job_id: str) -> list[Stored]:
        check_job_id(job_id)
        try:
            return await read_job(self.store, job_id)
        except HistoryGap as exc:
            raise ClientError(str(exc), EXIT_ERROR) from None

    async def events(self, job_id: str, *, telemetry: bool = True, final_wait_s: float = jobview.FINAL_WAIT_S
                     ) -> AsyncGenerator[Event, None]:
        """The job's events from its submission on, as typed catalog objects, live: its control history and
        (with `telemetry`) what its ranks publish, each in its stream's order, until the job ends (a completed job:
        with its final checkpoint's commit, which may come just after JobCompleted, or `final_wait_s` later without
        it). Its submission comes first."""
        following = self.events_stored(job_id, telemetry=telemetry, final_wait_s=final_wait_s)
        admission = Admission()  # what the services would refuse (forged, another job's) is no event of the job
        async with contextlib.aclosing(following) as stored_events:
            async for stored in stored_events:
                if stored.event is not None and not admission.refusal(stored):
                    yield stored.event

    async def events_stored(self, job_id: str, *, telemetry: bool = True, final_wait_s: float = jobview.FINAL_WAIT_S
                            ) -> AsyncGenerator[Stored, None]:
        """As `events`, with where each was stored (stream, sequence, subject); undecodable ones too."""
        await self.status(job_id)  # no such job: say so rather than wait forever
        queue: asyncio.Queue[Stored | BaseException] = asyncio.Queue()

        async def pump(stream: str, pattern: str) -> None:
            try:
                async for stored in self.store.follow(stream, [pattern]):
                    queue.put_nowait(stored)
            except Exception as exc:  # the reader failed: the consumer hears why
                queue.put_nowait(exc)

        readers = [asyncio.create_task(pump(subjects.CONTROL, subjects.job_all(job_id)))]
        view = JobView(job_id=job_id)
        admission = Admission()  # the view folds what the services fold
        final_by: float | None = None  # the loop's time, once the job completed with its final checkpoint to come
        try:
            while True:
                try:
                    async with asyncio.timeout_at(final_by):
                        item = await queue.get()
                except TimeoutError:
                    return  # completed; its final checkpoint did not come (the service stopped looking for it)
                if isinstance(item, BaseException):
                    raise item
                if telemetry and len(readers) == 1:
                    # Its telemetry from the start, read once its submission is in hand: that comes first (a rank
                    # reports only after it), even when the control reader's first fetch is the slower one.
                    readers.append(asyncio.create_task(pump(subjects.TELEMETRY, subjects.telemetry_job(job_id))))
                yield item
                if (item.stream == subjects.CONTROL and isinstance(item.event, JobEvent)
                        and not admission.refusal(item)):
                    view = jobview.evolve(view, item.event)
                    if view.ended and not view.final_checkpoint_pending:
                        return
                    if view.ended and final_by is None:
                        final_by = asyncio.get_running_loop().time() + final_wait_s
        finally:
            await stop_readers(readers)

    async def follow(self, types: Collection[type[Event]] = (), *, after_seq: int | None = None
                     ) -> AsyncGenerator[Stored, None]:
        """Every job's and node's control events of `types` (default: all of them), live and forever, for automation
        that reacts to any job (examples/webhook_notifier). From the control stream's sequence `after_seq` on (None:
        only events stored from now): keep the `seq` of the last one handled and pass it back after a restart, and
        nothing between is missed or seen twice. Telemetry types are refused: they are the ranks' firehose."""
        patterns = [p for t in types for p in _control_patterns(t)] or ["fd.ctl.job.>", "fd.ctl.node.>"]
        start = await self.last_seq() if after_seq is None else after_seq
        async for stored in self.store.follow(subjects.CONTROL, patterns, from_seq=start + 1):
            yield stored

    async def last_seq(self) -> int:
        """The control stream's last sequence: where `follow(after_seq=...)` starts to see only what comes next."""
        return await self.store.last_seq(subjects.CONTROL)

    async def wait(self, job_id: str, phases: Collection[str] = ENDED, *, timeout_s: float | None = None,
                   final_wait_s: float = jobview.FINAL_WAIT_S) -> JobView:
        """Until the job is in one of `phases` (default: any end); TimeoutError after `timeout_s`. A completed job
        comes with its final checkpoint, which may be committed just after JobCompleted, or `final_wait_s` later
        without it (as in `events`)."""
        def done(view: JobView) -> bool:
            return view.phase in phases and not view.final_checkpoint_pending

        async def until() -> JobView:
            view = await self.status(job_id)
            if done(view):
                return view
            async with contextlib.aclosing(self.events(job_id, telemetry=False, final_wait_s=final_wait_s)) as events:
                async for event in events:
                    if isinstance(event, JobEvent):
                        view = jobview.evolve(view, event)
                        if done(view):
                            return view
            return await self.status(job_id)  # it ended in another phase
        return await asyncio.wait_for(until(), timeout_s)

    # -- internals -------------------------------------------------------------------------------------------

    async def _command(self, job_id: str, command: Command, takes: tuple[str, ...]) -> None:
        """Append `command` when the job's recorded phase is one of `takes`; otherwise say why not, sending nothing.
        (Two people pausing at once may both be sent: a paused rank takes a second pause as a no-op.)"""
        view = await self.status(job_id)
        if view.phase not in takes:
            raise ClientError(refusal(job_id, view, type(command).__name__), EXIT_ERROR)
        await append_to_job(self.store, self._stamped(command))

    def _stamped(self, event: E, now: float | None = None) -> E:
        return msgspec.structs.replace(event, event_id=uuid.uuid4().hex,
                                       occurred_at=time.time() if now is None else now, producer=self.producer)

    async def _newest_step(self, job_id: str) -> StepCompleted | None:
        last = await self.store.last(subjects.TELEMETRY, f"fd.tel.{subjects.token(job_id)}.*.StepCompleted")
        return last.event if last is not None and isinstance(last.event, StepCompleted) else None


def refusal(job_id: str, view: JobView, command: str) -> str:
    """Why a job in `view`'s phase does not take `command`, in words a person can act on."""
    if view.phase == "paused" and command == "PauseRequested":
        return f"{job_id} is paused already ({view.paused}); nothing sent"
    if view.phase == "running" and command == "ResumeRequested":
        return f"{job_id} is running, not paused; nothing sent"
    return f"{job_id} is {view.phase}: only a running job's ranks take commands; nothing sent"


def read_spec(path: Path) -> JobSpec:
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1)  # never more: `submit /dev/zero` must not fill memory
    except OSError as exc:
        raise ClientError(f"cannot read {path}: {exc.strerror or exc}", EXIT_NOT_FOUND) from None
    try:
        return parse_spec(text)
    except InvalidSpec as exc:
        raise ClientError(f"{path}: {exc}", EXIT_INVALID) from None


def _control_patterns(t: type[Event]) -> tuple[str, ...]:
    """The control subjects every event of type `t` goes under (events/subjects.py's grammar)."""
    if issubclass(t, JobEvent) and not issubclass(t, RankEvent):
        return subjects.job_types(t.__name__)
    if issubclass(t, NodeEvent):
        return (f"fd.ctl.node.*.{t.__name__}",)
    raise ValueError(f"{t.__name__} is not a job's or a node's control event: follow one job's telemetry with "
                     "`events(job_id)`")


def check_job_id(job_id: str) -> None:
    try:
        subjects.token(job_id)
    except subjects.InvalidSubjectToken as exc:
        raise ClientError(str(exc), EXIT_NOT_FOUND) from None


def _events(history: list[Stored]) -> list[Event]:
    # What the services fold, and only that (events/admission.py). An event this version cannot decode (a newer
    # schema) is left out too: the rest still says where the job is.
    return admitted_events(history)


async def stop_readers(tasks: list[asyncio.Task[None]], tries: int = 20) -> None:
    """Cancel `tasks` until every one has stopped (Python 3.11's wait_for can drop a cancel: gh-86296)."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(tries):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    raise RuntimeError(f"{len(pending)} event readers ignored {tries} cancels")
