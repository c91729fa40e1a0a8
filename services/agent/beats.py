"""The node agent's heartbeat relay: its ranks hand their beats over a node-local datagram socket
(events/nodelocal.py) and the agent publishes one RankHeartbeats per job and attempt per heartbeat interval
(events/heartbeats.py), instead of one JetStream message per rank per interval.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import contextlib
import os
import socket
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from flightdeck.events import subjects
from flightdeck.events.heartbeats import LocalBeat, RankBeat, RankHeartbeats
from flightdeck.events.store import EventStore
from flightdeck.services.shell.connection import TRANSIENT

log = structlog.get_logger("flightdeck.agent.beats")

IDLE_GROUPS_AFTER = 10  # intervals without a beat before a (job, attempt) is forgotten
RCVBUF = 1 << 20  # room for bursts: a beat is ~60 bytes
MAX_DATAGRAM = 512
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_decoder = msgspec.msgpack.Decoder(LocalBeat)
LOG_EVERY_S = 10.0

Publish = Callable[[RankHeartbeats], Awaitable[None]]
Admit = Callable[[LocalBeat, int], bool]


@dataclass(slots=True)
class _Group:
    interval_s: float
    low: int  # the lowest rank seen: the batch's subject rank
    pending: dict[int, RankBeat] = field(default_factory=dict)
    sent_at: float = float("-inf")  # monotonic
    heard_at: float = 0.0  # monotonic
    n: int = 0
    held: bool = False  # the agent runs this attempt's ranks: a batch goes out every interval, empty or not


class Batches:
    def __init__(self, node: str, producer: str, boot: str) -> None:
        self.node, self.producer, self.boot = node, producer, boot
        self.groups: dict[tuple[str, int], _Group] = {}

    def add(self, beat: LocalBeat, now: float) -> bool:
        """Keep `beat` as its rank's newest; True when its group had nothing pending (the flusher may sleep)."""
        key = (beat.job_id, beat.attempt)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group(interval_s=beat.interval_s, low=beat.rank)
        g.low, g.interval_s, g.heard_at = min(g.low, beat.rank), beat.interval_s, now
        was_idle = not g.pending
        old = g.pending.get(beat.rank)
        if old is None or beat.occurred_at >= old.occurred_at:
            # a newer step's time survives a later beat of the same step (the step is what the monitor reads)
            step_time = beat.step_time_s or (old.step_time_s if old is not None and old.step == beat.step else 0.0)
            g.pending[beat.rank] = RankBeat(rank=beat.rank, step=beat.step, occurred_at=beat.occurred_at,
                                            step_time_s=step_time)
        return was_idle

    def hold(self, job_id: str, attempt: int, interval_s: float, low: int, now: float) -> None:
        """The agent started ranks of this attempt: send its batch every interval until `release`, empty when no
        rank beat, so the health monitor hears the agent itself (its silence means the node is lost)."""
        g = self.groups.get((job_id, attempt))
        if g is None:
            g = self.groups[(job_id, attempt)] = _Group(interval_s=interval_s, low=low, heard_at=now)
        g.held, g.low = True, min(g.low, low)

    def release(self, job_id: str, attempt: int) -> None:
        g = self.groups.get((job_id, attempt))
        if g is not None:
            g.held = False

    def due_at(self) -> float | None:
        """When the next group with pending beats (or held) is due (monotonic), None when none is."""
        times = [g.sent_at + g.interval_s for g in self.groups.values() if g.pending or g.held]
        return min(times) if times else None

    def take_due(self, now: float, wall: float) -> list[RankHeartbeats]:
        out: list[RankHeartbeats] = []
        for (job_id, attempt), g in list(self.groups.items()):
            if not g.pending and not g.held:
                if now - g.heard_at > IDLE_GROUPS_AFTER * g.interval_s:
                    del self.groups[(job_id, attempt)]  # the attempt ended here
                continue
            if now < g.sent_at + g.interval_s:
                continue
            g.n += 1
            beats = [g.pending[r] for r in sorted(g.pending)]
            g.pending, g.sent_at = {}, now
            out.append(RankHeartbeats(
                job_id=job_id, rank=g.low, attempt=attempt, node=self.node, interval_s=g.interval_s, beats=beats,
                event_id=f"{self.producer}:beats:{job_id}:{attempt}:{self.boot}:{g.n}", occurred_at=wall,
                producer=self.producer))
        return out


def new_address(node: str) -> str:
    """A fresh abstract socket name for this agent process (see flightdeck.events.nodelocal.sockaddr)."""
    return f"@flightdeck-beats-{node}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class BeatRelay:
    def __init__(self, *, node: str, producer: str, publish: Publish, admit: Admit | None = None,
                 address: str | None = None) -> None:
        self.address = address or new_address(node)
        self.batches = Batches(node, producer, uuid.uuid4().hex[:8])
        self.publish, self.admit = publish, admit
        self.received = self.rejected = self.invalid = 0
        self._sock: socket.socket | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._logged_at = 0.0

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the kernel stamps each datagram's pid
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            sock.bind("\0" + self.address[1:] if self.address.startswith("@") else self.address)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        self._task = asyncio.create_task(self._flush_forever())

    def hold(self, job_id: str, attempt: int, interval_s: float, low: int) -> None:
        self.batches.hold(job_id, attempt, interval_s, low, time.monotonic())
        self._wake.set()

    def release(self, job_id: str, attempt: int) -> None:
        self.batches.release(job_id, attempt)

    async def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _readable(self) -> None:
        assert self._sock is not None
        now = time.monotonic()
        wake = False
        for _ in range(1024):  # then let the loop breathe; the reader fires again
            try:
                data, ancillary, _flags, _addr = self._sock.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(_CREDS.size))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.warning("beat socket read failed", error=repr(exc))
                break
            pid = next((_CREDS.unpack_from(d)[0] for lvl, kind, d in ancillary
                        if lvl == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(d) >= _CREDS.size), 0)
            try:
                beat = _decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
                self.invalid += 1
                self._complain("invalid beat on the heartbeat socket", pid=pid, error=str(exc)[:200])
                continue
            if self.admit is not None and not self.admit(beat, pid):
                self.rejected += 1
                self._complain("beat from a process that is not that rank", pid=pid, job_id=beat.job_id,
                               attempt=beat.attempt, rank=beat.rank)
                continue
            self.received += 1
            wake = self.batches.add(beat, now) or wake
        if wake:
            self._wake.set()

    def _complain(self, what: str, **context: object) -> None:
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning(what, invalid=self.invalid, rejected=self.rejected, **context)

    async def _flush_forever(self) -> None:
        while True:
            due = self.batches.due_at()
            wait = None if due is None else due - time.monotonic()
            if wait is None or wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # not wait_for: on 3.11 it can swallow close's cancel
                        await self._wake.wait()
            for batch in self.batches.take_due(time.monotonic(), time.time()):
                await self.publish(batch)


def store_publisher(store: EventStore) -> Publish:
    """Publish a batch, or drop it when the broker does not take it within its interval (the next is newer)."""
    dropped = 0
    logged_at = 0.0

    async def publish(batch: RankHeartbeats) -> None:
        nonlocal dropped, logged_at
        subject = subjects.telemetry(batch.job_id, batch.rank, "RankHeartbeats")
        try:
            async with asyncio.timeout(batch.interval_s):
                await store.append(subject, batch, msg_id=batch.event_id)
        except TRANSIENT as exc:
            dropped += 1
            if time.monotonic() - logged_at >= 10.0:
                logged_at = time.monotonic()
                log.warning("heartbeat batch dropped: the broker did not take it in time", job_id=batch.job_id,
                            attempt=batch.attempt, beats=len(batch.beats), dropped=dropped, error=repr(exc))
    return publish
