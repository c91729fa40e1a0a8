"""A rank's link to its node agent (events/ranklink.py), the rank's only link to the platform: its events go up,
the job's commands, its parallel plan and "the rollback checkpoint is ready" come down. One daemon thread does the
socket's I/O and the heartbeat, so the training step only appends to a backlog (microseconds) and never waits.

Heartbeats go as datagrams to the agent's relay (events/nodelocal.BeatChannel), which batches a node's ranks;
an agent that relays none (`--heartbeats rank`) gets them as Heartbeat events on the link instead.
"""

import contextlib
import os
import selectors
import socket
import threading
import time
from typing import Any, Protocol

import msgspec
import structlog

from flightdeck.events import codec, ranklink
from flightdeck.events.backlog import Backlog
from flightdeck.events.base import Event, RankEvent
from flightdeck.events.heartbeats import LocalBeat
from flightdeck.events.nodelocal import BeatChannel
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.training import Heartbeat

HELLO_WAIT_S = 120.0  # a loaded agent may take a while to record the start it is asked to confirm
PLAN_WAIT_S = 30.0  # for the resharder's plan of a new world, recorded a moment after the grant that starts it
IDLE_WAKE_S = 0.5
BATCH = 256

log = structlog.get_logger("flightdeck.trainer.link")


def uuid4_hex() -> str:
    """A random (version 4) UUID as 32 hex digits; `uuid.uuid4().hex` costs ~6 µs here, this ~1 µs."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()


class AgentUnreachable(RuntimeError):
    """The node agent that started this rank does not answer, or does not know it."""


class AgentLink:
    """One rank's link. `connect` once, then `emit`/`set_step` from any thread, `poll` at step boundaries,
    `close` once at the end."""

    def __init__(self, address: str, job_id: str, rank: int, attempt: int, node: str, *, heartbeat_s: float = 1.0,
                 capacity: int = 10_000, beats: BeatChannel | None = None) -> None:
        self.address = address
        self._job_id, self._rank, self._attempt, self._node = job_id, rank, attempt, node
        self._heartbeat_s = heartbeat_s
        self._beats = beats
        self._backlog = Backlog(capacity)
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sleeping = False
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._commands: list[Event] = []
        self._plan: ParallelPlan | None = None
        self._ready: dict[str, ranklink.RollbackReady] = {}
        self._progress = (0, 0.0)  # (last completed step, its duration): read by the heartbeat as one value
        self._unsent: bytes | None = None  # a message the socket had no room for yet
        self._sent = 0  # events handed to the agent
        self._taken = 0  # events the agent confirmed it holds
        self._closing = False
        self.gone = False  # the agent closed the link (it died, or refused us): the rank stops at its next boundary
        self.num_refused = 0  # events the agent would not take (not this rank's to send)

    # -- starting ------------------------------------------------------------------------------------------

    def connect(self, timeout: float = HELLO_WAIT_S) -> None:
        """Connect and be recognised as this rank; raises AgentUnreachable."""
        sock = ranklink.link_socket()
        try:
            sock.settimeout(timeout)
            sock.connect(ranklink.sockaddr(self.address))
            sock.send(ranklink.ENCODER.encode(ranklink.Hello(job_id=self._job_id, attempt=self._attempt,
                                                              rank=self._rank)))
            answer = ranklink.DOWN_DECODER.decode(sock.recv(ranklink.MAX_MESSAGE))
        except (OSError, msgspec.DecodeError) as exc:
            sock.close()
            raise AgentUnreachable(f"the node agent's link {self.address} does not answer: {exc!r}") from None
        if not isinstance(answer, ranklink.Welcome):
            sock.close()
            why = answer.reason if isinstance(answer, ranklink.Refused) else type(answer).__name__
            raise AgentUnreachable(f"the node agent refused this rank's link: {why}")
        sock.setblocking(False)
        self._sock = sock

    def start(self) -> None:
        assert self._sock is not None, "connect() first"
        self._thread = threading.Thread(target=self._run, name=f"agent-link-{self._rank}", daemon=True)
        self._thread.start()

    # -- what the training thread calls ---------------------------------------------------------------------

    def emit(self, event: RankEvent) -> None:
        """Queue one event; never blocks. Stamps `event_id`, `occurred_at` and `producer` when empty."""
        if self._closing:
            return
        if not (event.event_id and event.occurred_at and event.producer):
            event = msgspec.structs.replace(event, event_id=event.event_id or uuid4_hex(),
                                            occurred_at=event.occurred_at or time.time(),
                                            producer=event.producer or "trainer")
        self._backlog.push(event)
        if self._sleeping:
            self._sleeping = False
            self._nudge()

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        self._progress = (step, step_time_s)

    def beat_now(self) -> None:
        """Tell the agent the step now, not at the next beat: the steps a snapshot of the last boundary covers
        must be on its record before the rank exits (services/agent/snapshots.py `choose`)."""
        if not self._closing:
            self._beat()

    def poll(self) -> list[Event]:
        """Commands received since the last poll, in history order."""
        if not self._commands:  # unlocked peek: the common step has nothing to hand over
            return []
        with self._cond:
            out, self._commands = self._commands, []
        return out

    def plan(self, world_size: int, wait_s: float) -> ParallelPlan | None:
        """The newest plan the agent passed on if it is for `world_size`, waiting up to `wait_s` for one (the
        resharder records a new world's plan a moment after the grant that starts its ranks)."""
        with self._cond:
            self._cond.wait_for(lambda: self.gone or (self._plan is not None and self._plan.world_size == world_size),
                                wait_s)
            return self._plan if self._plan is not None and self._plan.world_size == world_size else None

    def rollback_ready(self, checkpoint_id: str, wait_s: float) -> ranklink.RollbackReady | None:
        """The agent's word on a rollback's checkpoint in this node's cache, waiting up to `wait_s` for it."""
        with self._cond:
            self._cond.wait_for(lambda: self.gone or checkpoint_id in self._ready, wait_s)
            return self._ready.get(checkpoint_id)

    @property
    def num_dropped(self) -> int:
        return self._backlog.num_dropped

    @property
    def num_pending(self) -> int:
        return len(self._backlog) + (self._sent - self._taken)

    def close(self, timeout: float = 5.0) -> None:
        """Hand what is queued to the agent within `timeout` (it publishes it after this rank is gone), then stop.
        Call it on every exit, a crash included, so the FaultInjected/RankFault just emitted lands."""
        if self._closing:
            return
        self._closing = True
        self._nudge()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("link.close_stuck", pending=self.num_pending)
        lost = self.num_pending
        if lost and not self.gone:
            log.error("link.lost_at_close", lost=lost, kept=self._backlog.count_kept())
        if self._thread is None or not self._thread.is_alive():
            self._shut()

    # -- the link's thread ------------------------------------------------------------------------------------

    def _nudge(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _shut(self) -> None:
        if self._sock is not None:
            self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        next_beat = time.monotonic()
        try:
            while not self.gone:
                blocked = self._send()
                if self._closing and not blocked and not len(self._backlog) and self._taken >= self._sent:
                    return
                sel.modify(self._sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if blocked else 0))
                now = time.monotonic()
                if now >= next_beat and not self._closing:
                    self._beat()
                    next_beat = now + self._heartbeat_s
                wait = IDLE_WAKE_S if self._closing else min(max(next_beat - now, 0.0), IDLE_WAKE_S)
                self._sleeping = not blocked
                if self._sleeping and len(self._backlog):  # an emit racing the flag has queued: no sleep
                    wait = 0.0
                for key, _ in sel.select(wait):
                    if key.fileobj == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                    else:
                        self._receive()
                self._sleeping = False
        except Exception as exc:  # the link is this rank's only way out: say why it broke
            log.error("link.failed", error=f"{type(exc).__name__}: {exc}")
            self._lost()
        finally:
            sel.close()

    def _send(self) -> bool:
        """Send queued events until the socket is full; True when it is (wait until writable)."""
        assert self._sock is not None
        while True:
            if self._unsent is None:
                events = self._backlog.take(BATCH)
                if not events:
                    return False
                self._unsent = self._batch(events)
                if self._unsent is None:
                    continue
            try:
                self._sock.send(self._unsent)
            except BlockingIOError:
                return True
            except OSError as exc:
                log.error("link.send_failed", error=repr(exc))
                self._lost()
                return False
            self._unsent = None

    def _batch(self, events: list[RankEvent]) -> bytes | None:
        raws: list[bytes] = []
        for event in events:
            raw = codec.encode(event)
            if len(raw) > ranklink.MAX_MESSAGE // 2:
                log.error("link.event_too_large", type=codec.type_name(event), bytes=len(raw))
                continue
            raws.append(raw)
        if not raws:
            return None
        self._sent += len(raws)
        return ranklink.ENCODER.encode(ranklink.Events(upto=self._sent, events=raws))

    def _receive(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(ranklink.MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError as exc:
                log.error("link.receive_failed", error=repr(exc))
                self._lost()
                return
            if not data:
                self._lost()
                return
            try:
                self._take(ranklink.DOWN_DECODER.decode(data))
            except (msgspec.DecodeError, codec.UndecodableEvent) as exc:
                log.error("link.undecodable", error=str(exc)[:300])

    def _take(self, msg: Any) -> None:
        with self._cond:
            match msg:
                case ranklink.Taken(upto=upto, refused=refused):
                    self._taken, self.num_refused = max(self._taken, upto), self.num_refused + refused
                case ranklink.Command(event=raw):
                    self._commands.append(codec.decode(raw))
                case ranklink.Plan(plan=plan):
                    self._plan = plan
                case ranklink.RollbackReady(checkpoint_id=cid):
                    self._ready[cid] = msg
                case ranklink.Refused(reason=reason):
                    log.error("link.refused", reason=reason)
            self._cond.notify_all()

    def _lost(self) -> None:
        if not self.gone and not self._closing:
            log.error("link.agent_gone", address=self.address,
                      detail="the node agent closed this rank's link: stopping at the next step boundary")
        with self._cond:
            self.gone = True
            self._cond.notify_all()

    def _beat(self) -> None:
        step, step_time = self._progress
        if self._beats is not None:
            beat = LocalBeat(job_id=self._job_id, attempt=self._attempt, rank=self._rank, step=step,
                             occurred_at=time.time(), interval_s=self._heartbeat_s,
                             step_time_s=max(step_time, 0.0) if step >= 0 else 0.0)
            if self._beats.send(beat):
                return
            log.warning("link.relay_gone", address=self._beats.address,
                        detail="the node agent's heartbeat socket does not answer: heartbeating on the link")
            self._beats.close()
            self._beats = None
        self._backlog.push(Heartbeat(job_id=self._job_id, rank=self._rank, attempt=self._attempt, node=self._node,
                                     step=step, interval_s=self._heartbeat_s, event_id=uuid4_hex(),
                                     occurred_at=time.time(), producer="trainer"))


class Offline:
    """No platform: nothing to tell and nobody to hear (a JSON-lines events log may still keep what is emitted)."""

    gone = False

    def emit(self, event: RankEvent) -> None:
        pass

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        pass

    def beat_now(self) -> None:
        pass

    def close(self, timeout: float = 5.0) -> None:
        pass

    def poll(self) -> list[Event]:
        return []

    def plan(self, world_size: int, wait_s: float) -> ParallelPlan | None:
        return None

    def rollback_ready(self, checkpoint_id: str, wait_s: float) -> ranklink.RollbackReady | None:
        return None


class AgentSide(Protocol):
    """What a run hears from its node agent; trainer.link.AgentLink (and Offline, with no platform) has this shape."""

    gone: bool  # the agent closed the link: stop at the next boundary rather than train blind

    def poll(self) -> list[Event]:
        """Commands received since the last poll, in order."""

    def plan(self, world_size: int, wait_s: float) -> ParallelPlan | None:
        """The job's recorded plan for this world size, waiting up to `wait_s` for one."""

    def rollback_ready(self, checkpoint_id: str, wait_s: float) -> ranklink.RollbackReady | None:
        """Where this node's agent put a rollback's checkpoint (or why it could not), waiting up to `wait_s`."""


def admitted(raws: list[bytes]) -> list[Event]:
    """The agreed commands that pass `codec.admit`; a refused one is logged and not acted on. Every rank
    decodes the same agreed bytes, so every rank refuses the same commands and the collectives stay in step."""
    out: list[Event] = []
    for raw in raws:
        try:
            out.append(codec.admit(raw))  # the bounds too: a rollback's checkpoint id becomes a cache path
        except codec.UndecodableEvent as exc:
            log.error("refusing a command", error=str(exc))
    return out
