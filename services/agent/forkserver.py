"""The agent's end of its node's fork server (trainer/forkserver.py): one warm process, torch imported once, that
forks the node's standbys and its self-check. Without it every standby and self-check imported torch itself: about
3 CPU-seconds each, which on a 2-core node slowed the very ranks they stood by for.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import collections
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog

from flightdeck.events.nodelocal import (
    FORK_SERVER_DECODER,
    MAX_MESSAGE,
    Assignment,
    ChildExited,
    Forked,
    ForkRefused,
    ForkRequest,
    ServerReady,
)

log = structlog.get_logger("flightdeck.agent")
_encoder = msgspec.msgpack.Encoder()


class ForkServerGone(Exception):
    """The fork server cannot fork (it never warmed up, it died, or it refused): start the process cold."""


class ForkedProc:
    """A process the fork server forked. Its parent is the fork server, which reports its exit; the agent uses it
    as it uses an asyncio subprocess (pid, returncode, wait())."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def exited(self, code: int) -> None:
        if not self._done.done():
            self.returncode = code
            self._done.set_result(code)


class ForkServer:
    def __init__(self, *, python: str, env: dict[str, str], cwd: Path, log_file: Path,
                 preexec: Callable[[], None], preload: tuple[str, ...] = ()) -> None:
        self.python, self.env, self.cwd, self.log_file, self.preexec = python, env, cwd, log_file, preexec
        self.preload = preload  # the jobs' own modules, imported after the trainer's (the agent's --preload)
        self.proc: asyncio.subprocess.Process | None = None
        self.sock: socket.socket | None = None
        self.ready = False  # all a rank imports is in: standbys can be forked
        self.base_ready = False  # torch is in: the self-check can be forked, while the server imports the rest
        self.gone = False
        self.settled = asyncio.Event()  # ready, or gone for good
        self.base_settled = asyncio.Event()  # base ready, or gone for good
        self.children: dict[int, ForkedProc] = {}  # forked and not yet reported exited
        self.forked = 0  # children forked so far
        self.pending: collections.deque[asyncio.Future[ForkedProc]] = collections.deque()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._run())

    async def wait_ready(self, *, complete: bool = True) -> bool:
        """True once the server can fork (`complete` false: with torch in, not yet all a rank imports); False if it
        never will (the caller starts its process cold)."""
        self.start()
        await (self.settled if complete else self.base_settled).wait()
        return (self.ready if complete else self.base_ready) and not self.gone

    async def standby(self, log_fd: int, standby_fd: int) -> ForkedProc:
        """A standby (trainer/standby.py's wait) with `log_fd` as its output and `standby_fd` as its socket."""
        return await self._fork(ForkRequest(), [log_fd, standby_fd], complete=True)

    async def run(self, assignment: Assignment, out_fd: int, *, complete: bool = False) -> ForkedProc:
        """A child that becomes `assignment` at once, its stdout and stderr on `out_fd`; forked as soon as torch is
        in (what it imports beyond that, it imports itself), or with `complete` once all a rank imports is in."""
        return await self._fork(ForkRequest(assignment=assignment), [out_fd], complete=complete)

    async def _fork(self, request: ForkRequest, fds: list[int], *, complete: bool) -> ForkedProc:
        if not await self.wait_ready(complete=complete) or self.sock is None:
            raise ForkServerGone("the fork server is not running")
        answer: asyncio.Future[ForkedProc] = asyncio.get_running_loop().create_future()
        try:
            # Non-blocking, but the message is small and read at once: it goes whole or not at all.
            socket.send_fds(self.sock, [_encoder.encode(request)], fds)
        except OSError as exc:
            raise ForkServerGone(f"the fork server is gone: {exc!r}") from exc
        self.pending.append(answer)
        return await answer

    async def close(self) -> None:
        """Stop the server; the children it forked die with it (PR_SET_PDEATHSIG), and are recorded as killed."""
        self.gone = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.settled.set()
        self.base_settled.set()

    # -- the server's side of the pair ---------------------------------------------------------------------

    async def _run(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started = time.monotonic()
        try:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                preload = ["--preload", ",".join(self.preload)] if self.preload else []
                self.proc = await asyncio.create_subprocess_exec(
                    self.python, "-m", "flightdeck.trainer.forkserver", "--fd", str(theirs.fileno()), *preload,
                    cwd=self.cwd,
                    env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True, preexec_fn=self.preexec, pass_fds=(theirs.fileno(),))
            finally:
                os.close(out)
                theirs.close()
        except OSError as exc:
            log.error("could not start the fork server; standbys start cold", error=repr(exc))
            mine.close()
            self._lost()
            return
        mine.setblocking(False)
        self.sock = mine
        log.info("fork server started", pid=self.proc.pid, preload=list(self.preload))
        loop = asyncio.get_running_loop()
        try:
            while not self.gone:
                message = await loop.sock_recv(mine, MAX_MESSAGE)
                if not message:
                    break
                self._on(FORK_SERVER_DECODER.decode(message), started)
        except (OSError, msgspec.DecodeError) as exc:
            log.error("fork server connection failed", error=repr(exc))
        finally:
            mine.close()
            self._lost()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            closing, self.gone = self.gone, True
            code = await self.proc.wait()
            orphans = [p for p in self.children.values() if p.returncode is None]
            if not closing:
                log.error("fork server gone; standbys start cold from now on", exit_code=code,
                          children_killed=len(orphans), log=str(self.log_file))
            elif orphans:
                log.warning("children of the fork server killed with it", pids=[p.pid for p in orphans])
            await asyncio.gather(*(_killed(p) for p in orphans))

    def _on(self, message: object, started: float) -> None:
        if isinstance(message, ServerReady):
            self.base_ready = True
            self.base_settled.set()
            if message.complete:
                self.ready = True
                self.settled.set()
            log.info("fork server ready" if message.complete else "fork server has torch",
                     warmup_s=round(time.monotonic() - started, 2), imports_s=message.warmup_s)
        elif isinstance(message, Forked):
            proc = ForkedProc(message.pid)
            self.children[message.pid] = proc
            self.forked += 1
            self._answer(proc)
        elif isinstance(message, ForkRefused):
            self._answer(ForkServerGone(f"the fork server refused: {message.reason}"))
        elif isinstance(message, ChildExited):
            child = self.children.pop(message.pid, None)
            if child is not None:
                child.exited(message.code)

    def _answer(self, result: ForkedProc | Exception) -> None:
        if not self.pending:
            return
        answer = self.pending.popleft()
        if answer.done():
            return
        if isinstance(result, Exception):
            answer.set_exception(result)
        else:
            answer.set_result(result)

    def _lost(self) -> None:
        self.ready = self.base_ready = False
        self.settled.set()
        self.base_settled.set()
        while self.pending:
            answer = self.pending.popleft()
            if not answer.done():
                answer.set_exception(ForkServerGone("the fork server is gone"))


async def _killed(p: ForkedProc) -> None:
    """A child of a dead fork server: it dies of PR_SET_PDEATHSIG (killed here too, in case); record it once gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    try:
        pidfd = os.pidfd_open(p.pid)
    except ProcessLookupError:
        p.exited(-signal.SIGKILL)
        return
    gone = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(pidfd, gone.set)
    try:
        await gone.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    p.exited(-signal.SIGKILL)
