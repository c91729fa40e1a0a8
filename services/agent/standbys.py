"""The node agent's warm standby ranks: processes with torch and the trainer imported (trainer/standby.py), so a
restarted rank skips the interpreter start and `import torch` (~4.5 s of a restart on CPU).

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from flightdeck.events.nodelocal import ASSIGNMENT_ENCODER, READY, Assignment
from flightdeck.services.agent.forkserver import ForkedProc, ForkServer, ForkServerGone
from flightdeck.services.agent.rankproc import Proc

log = structlog.get_logger("flightdeck.agent")

MAX_BACKOFF_S = 60.0
# A fork server still importing after this long is stuck: the rank starts cold rather than wait on.
FORK_WAIT_S = 120.0
# Jobs' own interpreters (services/agent/envs.py) kept warm at once, each a fork server with torch imported (a few
# hundred MB); the least recently used one with no ranks of its own makes room for the next.
ENV_SERVERS = 2


@dataclass(eq=False)
class Standby:
    proc: Proc  # forked by the fork server, or started cold
    sock: socket.socket  # the agent's end of the pair
    started: float  # time.monotonic()
    ready: bool = False
    taken: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class StandbyPool:
    def __init__(self, *, size: int, python: str, env: dict[str, str], cwd: Path, log_file: Path,
                 preexec: Callable[[], None], producer: str, refill_delay_s: float = 1.0,
                 forks: ForkServer | None = None) -> None:
        self.size, self.python, self.env, self.cwd, self.log_file = size, python, env, cwd, log_file
        self.forks = forks  # standbys are forked from it once it is warm; started cold without it
        self.producer = producer
        self.preexec, self.refill_delay_s = preexec, refill_delay_s
        self.idle: list[Standby] = []
        self.failures = 0  # standbys in a row that died while waiting
        self.refill: asyncio.Task[None] | None = None
        self.filling = False  # the refill task is starting processes (past its wait)
        self.closed = False
        self.on_change: Callable[[], None] = lambda: None  # the ready count may have moved (main.py reports it)
        self.env_forks: dict[str, ForkServer] = {}  # a job's own interpreter -> its fork server, least recent first
        self.closing: set[asyncio.Task[None]] = set()

    @property
    def ready(self) -> int:
        """Standbys that could become a rank now."""
        return sum(1 for s in self.idle if s.ready and s.proc.returncode is None)

    def start(self) -> None:
        """Fill the pool now (in the background)."""
        if self.forks is not None:
            self.forks.start()
        self._schedule(0.0)

    def take(self) -> Standby | None:
        """An idle standby (ready ones first, then the longest warming), or None; a refill is scheduled."""
        live = [s for s in self.idle if s.proc.returncode is None]
        if not live:
            return None
        best = max(live, key=lambda s: (s.ready, -s.started))
        self.idle.remove(best)
        best.taken = True
        self._schedule(self.refill_delay_s)
        self.on_change()
        return best

    def refill_after(self, going: Awaitable[object], max_s: float) -> None:
        """Refill only once the ranks just handed out have got going (`going`), or after `max_s`: on a node with few
        cores, new standbys importing torch beside them slowed the very restart they were kept for (bench/vs_peers.py
        saw a warm restart take 10.6 s against 6.2 s cold on 2 cores)."""
        if self.closed or self.filling:
            return
        if self.refill is not None and not self.refill.done():
            self.refill.cancel()  # still waiting: it waits for these ranks instead
        self.refill = asyncio.create_task(self._fill(self.refill_delay_s, going, max_s))

    def assign(self, standby: Standby, argv: list[str], env: dict[str, str], cwd: Path, log_fd: int) -> bool:
        """Hand the rank to `standby`; False if it is gone (start the rank another way)."""
        for task in standby.tasks:
            task.cancel()
        with contextlib.suppress(OSError):  # its READY, if sent and unread: closing over it resets the standby's read
            standby.sock.recv(len(READY))
        message = ASSIGNMENT_ENCODER.encode(Assignment(argv=argv, env=env, cwd=str(cwd)))
        try:
            # Non-blocking, but the socket is empty and the message small: it goes whole or not at all.
            socket.send_fds(standby.sock, [message], [log_fd])
        except OSError as exc:
            log.warning("standby gone before its assignment", pid=standby.proc.pid, error=repr(exc))
            _kill(standby)
            return False
        finally:
            standby.sock.close()
        return True

    def environment(self, python: str) -> None:
        """A job's own interpreter: its ranks are forked from a fork server of its own, started now, so that they
        start warm as the node's do (the node's standbys run the node's Python)."""
        if python == self.python or self.closed:
            return
        if python in self.env_forks:
            self.env_forks[python] = self.env_forks.pop(python)  # the most recent now
            return
        idle = [p for p, server in self.env_forks.items() if not server.children]
        if len(self.env_forks) >= ENV_SERVERS:
            if not idle:
                return  # every one serves running ranks: this job's start cold
            closing = asyncio.create_task(self.env_forks.pop(idle[0]).close())
            self.closing.add(closing)  # a reference until it is done: the loop holds tasks weakly
            closing.add_done_callback(self.closing.discard)
        key = hashlib.sha256(python.encode()).hexdigest()[:12]
        server = ForkServer(python=python, env=self.env, cwd=self.cwd, preexec=self.preexec,
                            log_file=self.log_file.with_name(f"forkserver-{key}.log"))
        self.env_forks[python] = server
        server.start()
        log.info("fork server for a job's interpreter", python=python, log=str(server.log_file))

    async def warm_start(self, cmd: list[str], env: dict[str, str], cwd: Path, log_fd: int, rank: int) -> Proc | None:
        """The rank started warm: handed to a standby, else forked from the node's fork server (once all a rank
        imports is in there: waiting for its imports beats a cold start, which would make them all again beside
        it), or from its job's interpreter's (`environment`); None: start it cold."""
        if cmd and cmd[0] != self.python:
            return await self._fork(self.env_forks.get(cmd[0]), cmd, env, cwd, log_fd, rank)
        while (standby := self.take()) is not None:
            if self.assign(standby, cmd, env, cwd, log_fd):
                log.info("rank handed to a standby", rank=rank, pid=standby.proc.pid, ready=standby.ready)
                return standby.proc
        return await self._fork(self.forks, cmd, env, cwd, log_fd, rank)

    @staticmethod
    async def _fork(forks: ForkServer | None, cmd: list[str], env: dict[str, str], cwd: Path, log_fd: int,
                    rank: int) -> Proc | None:
        if forks is None or forks.gone:
            return None
        try:
            async with asyncio.timeout(FORK_WAIT_S):
                if not await forks.wait_ready():
                    return None
            proc = await forks.run(Assignment(argv=cmd, env=env, cwd=str(cwd)), log_fd, complete=True)
        except (ForkServerGone, TimeoutError):
            return None
        log.info("rank forked", rank=rank, pid=proc.pid, python=forks.python)
        return proc

    async def close(self) -> None:
        """Kill the idle standbys (they hold nothing) and stop refilling; the fork server is left to its owner."""
        self.closed = True
        if self.refill is not None:
            self.refill.cancel()
        for s in self.idle:
            _kill(s)
            for task in s.tasks:
                task.cancel()
            s.sock.close()
        await asyncio.gather(*(s.proc.wait() for s in self.idle), return_exceptions=True)
        self.idle.clear()
        # The jobs' interpreters' servers are the pool's own: their ranks are stopped by now (spawner.shutdown).
        await asyncio.gather(*(server.close() for server in self.env_forks.values()), return_exceptions=True)
        self.env_forks.clear()
        self.on_change()  # the fork server stays: ranks it forked may still be stopping (its owner closes it last)

    # -- filling -------------------------------------------------------------------------------------------

    def _schedule(self, delay_s: float) -> None:
        if self.closed or (self.refill is not None and not self.refill.done()):
            return
        self.refill = asyncio.create_task(self._fill(delay_s))

    async def _fill(self, delay_s: float, going: Awaitable[object] | None = None, max_s: float = 0.0) -> None:
        structlog.contextvars.clear_contextvars()  # it outlives the input in hand when it was scheduled
        structlog.contextvars.bind_contextvars(service=self.producer)
        if going is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max_s):  # not wait_for: on 3.11 it can swallow the cancel of a refill
                    await asyncio.shield(going)  # shielded: the spawner's own to resolve
        await asyncio.sleep(delay_s)
        self.filling = True
        try:
            while not self.closed and len(self.idle) < self.size:
                try:
                    self.idle.append(await self._start_one())
                except OSError as exc:
                    log.error("could not start a standby", error=repr(exc))
                    self.failures += 1
                    await asyncio.sleep(self._backoff())
        finally:
            self.filling = False

    def _backoff(self) -> float:
        return min(MAX_BACKOFF_S, max(1.0, self.refill_delay_s) * 2 ** min(self.failures, 6))

    async def _start_one(self) -> Standby:
        forked = self.forks is not None and await self.forks.wait_ready()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                proc: Proc | None = None
                if forked and self.forks is not None:
                    with contextlib.suppress(ForkServerGone):  # then cold, as without a fork server
                        proc = await self.forks.standby(out, theirs.fileno())
                if proc is None:
                    proc = await asyncio.create_subprocess_exec(
                        self.python, "-m", "flightdeck.trainer.standby", "--fd", str(theirs.fileno()), cwd=self.cwd,
                        env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                        start_new_session=True, preexec_fn=self.preexec, pass_fds=(theirs.fileno(),))
            finally:
                os.close(out)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        s = Standby(proc=proc, sock=mine, started=time.monotonic())
        s.tasks = [asyncio.create_task(self._await_ready(s)), asyncio.create_task(self._watch(s))]
        log.info("standby started", pid=proc.pid, pool=len(self.idle) + 1, size=self.size,
                 forked=isinstance(proc, ForkedProc))
        return s

    async def _await_ready(self, s: Standby) -> None:
        got = await asyncio.get_running_loop().sock_recv(s.sock, 1)
        if got == READY:
            s.ready = True
            self.failures = 0
            log.info("standby ready", pid=s.proc.pid, warmup_s=round(time.monotonic() - s.started, 2))
            self.on_change()

    async def _watch(self, s: Standby) -> None:
        code = await s.proc.wait()
        if s.taken or self.closed:
            return
        with contextlib.suppress(ValueError):
            self.idle.remove(s)
        s.sock.close()
        if not s.ready:
            self.failures += 1
        log.warning("standby died while waiting; replacing it", pid=s.proc.pid, exit_code=code,
                    ready=s.ready, log=str(self.log_file))
        self.on_change()
        self._schedule(self._backoff() if self.failures else 0.0)


def _kill(s: Standby) -> None:
    if s.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGKILL)
