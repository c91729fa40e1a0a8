"""The node agent's end of its ranks' links (events/ranklink.py): the one place where the platform meets a rank.

Up: each rank's events are checked (its own job, attempt, rank and node; a type a rank may send; the bounds every
reader applies), taken into the agent's custody at once, and published in order on the rank's telemetry
subjects with their ids as msg ids, so a retry after a broker outage stores each once. Custody outlives the
rank: a crash's last FaultInjected is published even when the broker is away while the rank exits.
Down: the job's commands for the attempt, its parallel plan, and a rollback checkpoint's readiness.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import contextlib
import os
import socket
import struct
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats
import structlog

from flightdeck.events import codec, ranklink, subjects
from flightdeck.events.backlog import Backlog
from flightdeck.events.base import RankEvent
from flightdeck.events.catalog import RANK_TYPES
from flightdeck.events.checkpoint import CheckpointStaged
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.store import EventStore
from flightdeck.events.training import FaultInjected, RankFault, RolledBack, StepCompleted
from flightdeck.services.shell.connection import TRANSIENT

log = structlog.get_logger("flightdeck.agent.links")

CUSTODY = 20_000  # events held per rank while the broker is away; steps and heartbeats go first
BATCH = 256
RETRY_S = 0.5
SETTLE_S = 2.0  # the most a rank's exit record waits for its last events (a child holding its link open, a slow broker)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

Admit = Callable[[ranklink.Hello, int], Awaitable[bool]]
Key = tuple[str, int, int]  # job, attempt, rank


def new_address(node: str) -> str:
    return f"@flightdeck-link-{node}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(eq=False)
class _Rank:
    key: Key
    sock: socket.socket | None
    custody: Backlog = field(default_factory=lambda: Backlog(CUSTODY))
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    publisher: asyncio.Task[None] | None = None
    closed: bool = False  # the rank's end is gone: publish what is held, then forget it


@dataclass
class _Job:
    plan: ParallelPlan | None = None
    attempt: int = -1  # the attempt whose commands are kept for ranks that connect later
    commands: list[bytes] = field(default_factory=list)


# RankExit's fields from the link, for an agent without links
NOT_TOLD: dict[str, Any] = {"error": "", "early": False, "usage": False, "unlinked": False}
MAX_ERROR = 500  # of a rank's error line, in its exit record


class RankLinks:
    def __init__(self, *, node: str, store: EventStore, admit: Admit | None = None, address: str | None = None) -> None:
        self.node, self.store, self.admit = node, store, admit
        self.address = address or new_address(node)
        self.ranks: dict[Key, _Rank] = {}
        self.jobs: dict[str, _Job] = {}
        self.published = self.refused = self.rejected = 0
        self.staged: dict[Key, tuple[int, int]] = {}  # a rank's newest own staging (timeline, step): no persist below
        # a rank's last reported step (in order; a rollback's landing starts over from its step): a persisted
        # snapshot never runs ahead of the rank's record
        self.stepped: dict[Key, int] = {}
        self.linked: set[Key] = set()  # ranks that said Hello: they called flightdeck.init()
        # a rank's uncaught error as it recorded it on its way out, or the drill crash it was told to make
        self.faults: dict[Key, RankFault | FaultInjected] = {}
        self._server: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        server = ranklink.link_socket()
        try:
            server.bind(ranklink.sockaddr(self.address))
            server.listen(1024)
            server.setblocking(False)
        except OSError:
            server.close()
            raise
        self._server = server
        asyncio.get_running_loop().add_reader(server.fileno(), self._accept)

    # -- down: what the agent tells its ranks ------------------------------------------------------------------

    def command(self, job_id: str, attempt: int, raw: bytes) -> None:
        """A command of the attempt, to its ranks here now and to those that connect later."""
        job = self.jobs.setdefault(job_id, _Job())
        if job.attempt != attempt:
            job.attempt, job.commands = attempt, []
        if raw in job.commands:  # an input folded again (a lost ack) is told once: a rollback obeyed twice is two
            return
        job.commands.append(raw)
        self._tell(job_id, attempt, ranklink.Command(event=raw))

    def plan(self, job_id: str, plan: ParallelPlan) -> None:
        self.jobs.setdefault(job_id, _Job()).plan = plan
        self._tell(job_id, None, ranklink.Plan(plan=plan))

    def rollback_ready(self, job_id: str, checkpoint_id: str, path: str = "", problem: str = "") -> None:
        self._tell(job_id, None, ranklink.RollbackReady(checkpoint_id=checkpoint_id, path=path, problem=problem))

    def forget(self, job_id: str) -> None:
        """The job ended: nothing more is kept for it."""
        self.jobs.pop(job_id, None)
        for key in [k for k in self.staged if k[0] == job_id]:
            del self.staged[key]
        for key in [k for k in self.stepped if k[0] == job_id]:
            del self.stepped[key]
        self.linked = {k for k in self.linked if k[0] != job_id}
        for key in [k for k in self.faults if k[0] == job_id]:
            del self.faults[key]

    async def told(self, key: Key, beat_stepped: bool, settle_s: float = SETTLE_S) -> dict[str, Any]:
        """What a rank that just exited told through its link, as RankExit's fields: whether it ever called
        flightdeck.init(), whether it completed a step of its attempt (its reports, or `beat_stepped`: its
        heartbeats timed one, where ranks leave their steps to the agent), and the error it recorded (RankFault).
        Forgotten once read. Waits first, at most `settle_s`, until what the rank sent is published: its exit is
        then stored after its last events (a crash's FaultInjected before the WorkersExited it caused)."""
        r = self.ranks.get(key)
        if r is not None and r.publisher is not None:
            await asyncio.wait({r.publisher}, timeout=settle_s)
        linked = key in self.linked
        self.linked.discard(key)
        fault = self.faults.pop(key, None)
        error = "" if fault is None else f"drill fault 'crash' injected at step {fault.step}" \
            if isinstance(fault, FaultInjected) else f"{fault.error_type}: {fault.message}".splitlines()[0][:MAX_ERROR]
        return {"error": error, "early": key not in self.stepped and not beat_stepped,
                "usage": isinstance(fault, RankFault) and fault.usage, "unlinked": not linked}

    def _tell(self, job_id: str, attempt: int | None, msg: msgspec.Struct) -> None:
        data = ranklink.ENCODER.encode(msg)
        for (j, a, _), r in list(self.ranks.items()):
            if j == job_id and (attempt is None or a == attempt) and not r.closed:
                self._send(r, data)

    def _send(self, r: _Rank, data: bytes) -> None:
        if r.sock is None:
            return
        try:
            # Whole or not at all (SEQPACKET). The rank's link thread reads whatever its training does, into 4 MiB:
            # a full buffer means that thread is dead.
            r.sock.send(data)
        except OSError as exc:
            log.warning("link send failed; closing it", key=r.key, error=repr(exc))
            self._drop(r)

    # -- up: a rank's events ------------------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("link accept failed", error=repr(exc))
                return
            task = asyncio.create_task(self._serve(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        pid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        r: _Rank | None = None
        try:
            hello = ranklink.UP_DECODER.decode(await loop.sock_recv(sock, ranklink.MAX_MESSAGE))
            if not isinstance(hello, ranklink.Hello):
                raise msgspec.ValidationError("the first message must be a Hello")
            if self.admit is not None and not await self.admit(hello, pid):
                await loop.sock_sendall(sock, ranklink.ENCODER.encode(ranklink.Refused(
                    reason=f"process {pid} is not rank {hello.rank} of {hello.job_id} attempt {hello.attempt} here")))
                log.warning("link refused: not a rank this agent started", pid=pid, job_id=hello.job_id,
                            attempt=hello.attempt, rank=hello.rank)
                return
            key = (hello.job_id, hello.attempt, hello.rank)
            r = self._open(key, sock)
            self.linked.add(key)
            await loop.sock_sendall(sock, ranklink.ENCODER.encode(ranklink.Welcome()))
            job = self.jobs.get(hello.job_id)
            if job is not None and job.plan is not None:
                await loop.sock_sendall(sock, ranklink.ENCODER.encode(ranklink.Plan(plan=job.plan)))
            if job is not None and job.attempt == hello.attempt:
                for raw in job.commands:  # appended between the start and this link
                    await loop.sock_sendall(sock, ranklink.ENCODER.encode(ranklink.Command(event=raw)))
            while True:
                data = await loop.sock_recv(sock, ranklink.MAX_MESSAGE)
                if not data:
                    return
                msg = ranklink.UP_DECODER.decode(data)
                if not isinstance(msg, ranklink.Events):
                    raise msgspec.ValidationError(f"{type(msg).__name__} after the Hello")
                refused = self._take(r, msg.events)
                self._send(r, ranklink.ENCODER.encode(ranklink.Taken(upto=msg.upto, refused=refused)))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.rejected += 1
            log.warning("link closed: not the link protocol", pid=pid, error=str(exc)[:300])
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.info("link closed", pid=pid, error=repr(exc))
        finally:
            if r is not None:
                self._drop(r)
            else:
                sock.close()

    def _open(self, key: Key, sock: socket.socket) -> _Rank:
        old = self.ranks.get(key)
        if old is not None:  # the same rank again (a reconnect): its held events stay first in line
            if old.sock is not None:
                old.sock.close()
            old.sock, old.closed = sock, False
            return old
        r = self.ranks[key] = _Rank(key=key, sock=sock)
        r.publisher = asyncio.create_task(self._publish(r))
        return r

    def _drop(self, r: _Rank) -> None:
        if r.sock is not None:
            with contextlib.suppress(OSError):
                r.sock.close()
            r.sock = None
        r.closed = True
        r.wake.set()

    def _take(self, r: _Rank, raws: list[bytes]) -> int:
        job_id, attempt, rank = r.key
        refused = 0
        for raw in raws:
            try:
                event = codec.admit(raw)
            except codec.UndecodableEvent as exc:
                refused += 1
                log.warning("event from a rank refused", job_id=job_id, rank=rank, error=str(exc)[:300])
                continue
            if not isinstance(event, RANK_TYPES) or (event.job_id, event.attempt, event.rank, event.node) != (
                    job_id, attempt, rank, self.node):
                refused += 1
                log.warning("event from a rank refused: not its own to send", job_id=job_id, attempt=attempt,
                            rank=rank, type=type(event).__name__, claims=getattr(event, "job_id", ""))
                continue
            r.custody.push(event)
            if isinstance(event, CheckpointStaged):
                self.staged[r.key] = max(self.staged.get(r.key, (-1, -1)), (event.timeline, event.step))
            elif isinstance(event, StepCompleted):
                self.stepped[r.key] = event.step
            elif isinstance(event, RolledBack):
                self.stepped[r.key] = event.to_step - 1
            elif (isinstance(event, RankFault) and event.kind in ("exception", "cuda")) or \
                    (isinstance(event, FaultInjected) and event.kind == "crash"):
                self.faults[r.key] = event
        self.refused += refused
        r.wake.set()
        return refused

    async def _publish(self, r: _Rank) -> None:
        """Publish the rank's events in order until its link is closed and nothing is held."""
        job_id, _, rank = r.key
        while True:
            batch = r.custody.take(BATCH)
            if not batch:
                if r.closed:
                    if self.ranks.get(r.key) is r:
                        del self.ranks[r.key]
                    return
                r.wake.clear()
                await r.wake.wait()
                continue
            items = [(subjects.telemetry(job_id, rank, codec.type_name(e)), e) for e in batch]
            while True:
                try:
                    await self.store.append_batch(items)
                    self.published += len(items)
                    break
                except (nats.js.errors.BadRequestError, nats.js.errors.NotFoundError):
                    await self._one_by_one(items)  # one of them can never be stored: find it, keep the rest
                    break
                except TRANSIENT as exc:
                    log.warning("broker did not take a rank's events; retrying", job_id=job_id, rank=rank,
                                events=len(items), held=len(r.custody), error=repr(exc))
                    await asyncio.sleep(RETRY_S)

    async def _one_by_one(self, items: list[tuple[str, RankEvent]]) -> None:
        for subject, event in items:
            while True:
                try:
                    await self.store.append(subject, event, msg_id=event.event_id)
                    self.published += 1
                    break
                except (nats.js.errors.BadRequestError, nats.js.errors.NotFoundError) as exc:
                    log.error("a rank's event can never be stored; dropped", subject=subject,
                              event_id=event.event_id, error=repr(exc))
                    break
                except TRANSIENT:
                    await asyncio.sleep(RETRY_S)

    def held(self) -> int:
        return sum(len(r.custody) for r in self.ranks.values())

    async def close(self, drain_s: float = 5.0) -> None:
        """Stop taking links; publish what is held for up to `drain_s`."""
        if self._server is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._server.fileno())
            self._server.close()
            self._server = None
        for t in list(self._tasks):
            t.cancel()
        for r in list(self.ranks.values()):
            self._drop(r)
        publishers = [r.publisher for r in self.ranks.values() if r.publisher is not None]
        if publishers:
            _, pending = await asyncio.wait(publishers, timeout=drain_s)
            if pending:
                log.error("rank events lost at agent shutdown: the broker did not take them", held=self.held())
            for t in pending:
                t.cancel()
