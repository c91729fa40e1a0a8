"""What a rank prints: read by its node agent from the rank's stdout/stderr pipe, appended to the rank's log file
on the node, and shipped to FD_LOGS as RankOutput batches within a per-rank budget of lines and bytes a second,
so `flightdeck logs` shows it from any machine and a chatty script cannot crowd out telemetry.

Over the budget a rank's last lines are held, not dropped: HELD_LINES of them wait, and whatever of them is still
held when the rank ends (or goes quiet long enough for the budget to refill) is shipped, so its final words (a
traceback after a flood) reach `flightdeck logs`. The lines a user reads first go ahead of a flood on a budget of
their own: the trainer API's (structlog's console lines: time, [level], event), each traceback whole, and what
stderr carries by its form (a warning, a logging WARNING or ERROR; the two streams share one pipe). Each
line is shipped or counted as left out, once. The node's file takes everything up to LOG_FILE_BYTES (and the read
that crosses it), then moves to `<name>.1` (replacing the one before): a rank printing 6 MB/s once filled 100 MB in
16 s with no cap."""

import asyncio
import contextlib
import os
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from flightdeck.events import subjects
from flightdeck.events.logs import MAX_LINE, MAX_LINES, RankOutput
from flightdeck.events.store import EventStore
from flightdeck.services.shell.connection import TRANSIENT

log = structlog.get_logger("flightdeck.agent")

LINES_PER_S, LINE_BURST = 200.0, 2_000.0  # a rank's shipped lines: rate and burst
BYTES_PER_S, BYTE_BURST = 128 * 1024.0, 512 * 1024.0  # ... and bytes
FLUSH_S = 0.2  # a batch goes out at most this long after its first line
MAX_PENDING = 64  # batches waiting for the broker; past that the oldest is dropped (and counted)
PUBLISH_TIMEOUT_S = 5.0
READ_CHUNK = 64 * 1024
HELD_LINES = 100  # a flooding rank's last lines, kept back to ship when it ends
NEEDED_PER_S, NEEDED_BURST = 20.0, 400.0  # ... and the lines it needs read (API lines, tracebacks) beyond that
API_LINE = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:.]+Z? \[(debug|info|warning|error|critical|exception)\s*\] ")
# What a script's stderr carries, told by its form (stdout and stderr share the pipe): the warnings module's
# `file:line: SomeWarning: text`, and the logging module's default `WARNING:name:text` (and worse).
STDERR_LINE = re.compile(r"^(\S+:\d+: \w*Warning: |(WARNING|ERROR|CRITICAL):[\w.]*:)")
TRACEBACK = "Traceback (most recent call last):"
LOG_FILE_MB_ENV = "FLIGHTDECK_RANK_LOG_MB"
LOG_FILE_BYTES = int(float(os.environ.get(LOG_FILE_MB_ENV) or 64) * 1e6)  # a rank's node log file, then rotated

Publish = Callable[[RankOutput], Awaitable[None]]


class Budget:
    """A token bucket: `take(now, amount)` is True while the rate (with its burst) allows `amount` more."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, 0.0

    def take(self, now: float, amount: float) -> bool:
        if self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True


def cut(line: str) -> str:
    """A line no longer than MAX_LINE (plus the note of how much was cut)."""
    if len(line) <= MAX_LINE:
        return line
    return f"{line[:MAX_LINE]}... [{len(line) - MAX_LINE} more characters cut]"


class Lines:
    """Splits the bytes a rank writes into lines (a carriage return also ends one: progress bars)."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[str]:
        data = (self._rest + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *whole, self._rest = data.split(b"\n")
        if len(self._rest) > 4 * MAX_LINE:  # an endless line: ship what we have rather than hold it all
            whole.append(self._rest)
            self._rest = b""
        return [cut(w.decode(errors="replace")) for w in whole]

    def finish(self) -> list[str]:
        rest, self._rest = self._rest, b""
        return [cut(rest.decode(errors="replace"))] if rest else []


class OutputPump:
    """One rank's output, from its pipe to its log file and FD_LOGS."""

    def __init__(self, fd: int, log_path: Path, publish: Publish, *, job_id: str, attempt: int, rank: int,
                 node: str, producer: str) -> None:
        self.fd, self.log_path, self.publish = fd, log_path, publish
        self.job_id, self.attempt, self.rank, self.node, self.producer = job_id, attempt, rank, node, producer
        self.lines_budget, self.bytes_budget = Budget(LINES_PER_S, LINE_BURST), Budget(BYTES_PER_S, BYTE_BURST)
        self.needed_budget = Budget(NEEDED_PER_S, NEEDED_BURST)
        self.in_traceback = False  # since a TRACEBACK line, up to its exception's line (the first unindented one)
        self.batch: list[str] = []
        self.batch_since = 0.0
        self.next_line = 0  # number of the next line the rank prints, shipped or not
        self.first_line = 0  # number of the batch's first line
        self.dropped = 0  # lines over the budget since the last shipped batch
        self.num_dropped = 0
        self.num_shipped = 0
        self.pending: deque[RankOutput] = deque()
        self.held: deque[str] = deque()  # over-budget lines since the last shipped one, the newest HELD_LINES
        self.held_from = 0  # number of the first held line
        self.log_bytes = LOG_FILE_BYTES
        self._wake = asyncio.Event()
        self._eof = False

    async def run(self) -> None:
        """Until the rank and everything it started have closed the pipe; then ship what is left."""
        sender = asyncio.create_task(self._send())
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=4 * READ_CHUNK)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(self.fd, "rb", buffering=0))
        splitter = Lines()
        out = self.log_path.open("ab", buffering=0)
        written = out.tell()
        try:
            while True:
                try:
                    async with asyncio.timeout(FLUSH_S):  # not wait_for: on 3.11 it can swallow a cancel
                        chunk = await reader.read(READ_CHUNK)
                except TimeoutError:
                    self._release_held()
                    self._flush_if_due(force=bool(self.batch) or bool(self.dropped))
                    continue
                if not chunk:
                    break
                if written and written + len(chunk) > self.log_bytes:  # the node's copy: rotated, never unbounded
                    out.close()
                    os.replace(self.log_path, rotated(self.log_path))
                    out, written = self.log_path.open("ab", buffering=0), 0
                out.write(chunk)  # the budget is for the broker only
                written += len(chunk)
                for line in splitter.feed(chunk):
                    self._offer(line)
                self._flush_if_due()
            for line in splitter.finish():
                self._offer(line)
        finally:
            out.close()
            transport.close()
            self._release_held(final=True)
            self._flush_if_due(force=True)
            self._eof = True
            self._wake.set()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    def _needed(self, line: str) -> bool:
        """Whether the user reads this line first: one of the trainer API's, or one of a traceback's."""
        if line.startswith(TRACEBACK):
            self.in_traceback = True
            return True
        if self.in_traceback:
            self.in_traceback = line.startswith(" ")  # the exception's own line ends it, and is shipped too
            return True
        return API_LINE.match(line) is not None or STDERR_LINE.match(line) is not None

    def _offer(self, line: str) -> None:
        now = time.monotonic()
        number = self.next_line
        self.next_line += 1
        needed = self._needed(line)
        if not (self.lines_budget.take(now, 1) and self.bytes_budget.take(now, len(line) + 1)) \
                and not (needed and self.needed_budget.take(now, 1)):
            if self.batch:  # first: a batch's `dropped` counts lines left out *before* it, never after
                self._flush_if_due(force=True)
            if not self.held:
                self.held_from = number
            self.held.append(line)
            if len(self.held) > HELD_LINES:  # no longer among the last: left out
                self.held.popleft()
                self.held_from += 1
                self._left_out(1)
            return
        if self.held:  # a line within the budget after held ones: those were not the last after all
            if self.batch:  # held lines released since: a batch is contiguous, and the rest comes before this one
                self._flush_if_due(force=True)
            self._left_out(len(self.held))
            self.held.clear()
        self._add(number, line, now)

    def _add(self, number: int, line: str, now: float) -> None:
        if not self.batch:
            self.first_line, self.batch_since = number, now
        self.batch.append(line)
        if len(self.batch) >= MAX_LINES:
            self._flush_if_due(force=True)

    def _left_out(self, n: int) -> None:
        self.dropped += n
        self.num_dropped += n

    def _release_held(self, final: bool = False) -> None:
        """Ship the held lines the budget allows again (all of them when the rank has ended): a rank's last lines,
        which came after those left out (and counted) before them."""
        now = time.monotonic()
        while self.held and (final or (self.lines_budget.take(now, 1)
                                       and self.bytes_budget.take(now, len(self.held[0]) + 1))):
            self._add(self.held_from, self.held.popleft(), now)
            self.held_from += 1

    def _flush_if_due(self, force: bool = False) -> None:
        if not self.batch and force and self.dropped:  # say how many were left out even if none follow
            self.first_line = self.next_line
        elif not self.batch or not (force or time.monotonic() - self.batch_since >= FLUSH_S):
            return
        # A count with no lines shares its first_line with the batch that may follow it: its own id, or the
        # broker's de-duplication would take that batch for a resend and drop it.
        kind = "out" if self.batch else "gap"
        event = RankOutput(job_id=self.job_id, attempt=self.attempt, rank=self.rank, node=self.node,
                           first_line=self.first_line, lines=self.batch, dropped=self.dropped,
                           event_id=f"{self.producer}:{kind}:{self.job_id}:{self.attempt}:{self.rank}:{self.first_line}",
                           occurred_at=time.time(), producer=self.producer)
        self.batch, self.dropped = [], 0
        if len(self.pending) >= MAX_PENDING:  # the broker is away: keep the newest
            lost = self.pending.popleft()
            self.num_dropped += len(lost.lines)
        self.pending.append(event)
        self._wake.set()

    async def _send(self) -> None:
        while True:
            while self.pending:
                event = self.pending[0]
                try:
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        await self.publish(event)
                except TRANSIENT as exc:  # TimeoutError (the timeout's) included
                    if self._eof:
                        log.warning("rank output not shipped: the broker did not take it", job_id=self.job_id,
                                    rank=self.rank, batches=len(self.pending), error=repr(exc))
                        return
                    await asyncio.sleep(0.5)
                    continue
                if self.pending and self.pending[0] is event:
                    self.pending.popleft()
                self.num_shipped += len(event.lines)
            if self._eof:
                return
            self._wake.clear()
            await self._wake.wait()


def rotated(path: Path) -> Path:
    """Where a rank's log file goes when it reaches LOG_FILE_BYTES (rankproc.last_lines reads it too)."""
    return path.with_name(path.name + ".1")


def store_publisher(store: EventStore) -> Publish:
    async def publish(event: RankOutput) -> None:
        await store.append(subjects.logs(event.job_id, event.attempt, event.rank), event, msg_id=event.event_id)
    return publish
