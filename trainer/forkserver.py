"""A node's fork server: one process that imports torch and the trainer once, then forks the node's warm standbys
and its self-check from itself. Each then costs a fork (milliseconds) instead of an interpreter start and
`import torch` (about 3 CPU-seconds on CPU, most of a restart's CPU on a small node).

    python -m flightdeck.trainer.forkserver --fd K [--preload M1,M2]
        (started by the node agent: services/agent/forkserver.py)

Over the agent's SOCK_SEQPACKET pair (messages: events/nodelocal.py) we say ServerReady once warm, answer each
ForkRequest with Forked(pid) (or ForkRefused) in order, and send ChildExited when a child ends: we are its parent,
so only we can read its exit status. A child is in a session of its own and dies with us (PR_SET_PDEATHSIG), as we
die with the agent; it then runs as trainer/standby.py would, or becomes its assignment at once.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import argparse
import atexit
import contextlib
import ctypes
import gc
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

import msgspec

from flightdeck.events.nodelocal import (
    FORK_REQUEST_DECODER,
    MAX_MESSAGE,
    ChildExited,
    Forked,
    ForkRefused,
    ForkRequest,
    ForkServerMessage,
    ServerReady,
)
from flightdeck.trainer.standby import WARM_MODULES, agent_socket, become, wait_and_become, warm_up

PR_SET_PDEATHSIG = 1
# What the node's self-check needs (trainer/selfcheck.py): the server says so once these are in, and forks the
# check while it imports the rest, so the node registers as soon as it did with a check started cold.
BASE_MODULES = ("torch", "torch.distributed", "torch.multiprocessing")
SELFCHECK_WAIT_MS = 250
_encoder = msgspec.msgpack.Encoder()


class Child:
    """What a forked child runs once it has left the server's loop (it unwinds to `__main__` first)."""

    def __init__(self, body: Callable[[], int]) -> None:
        self.body = body

    def run(self) -> NoReturn:
        """Run the body and end as `python` ends a process: its exit code (SystemExit's, 1 after an uncaught
        exception shown by sys.excepthook, death by SIGINT after a KeyboardInterrupt), non-daemon threads joined,
        then atexit handlers, then buffers flushed. Then `os._exit`, without tearing the modules down: in a child
        that frees every object the server imported, and each free writes to a page shared with the server, so
        the kernel copies them all (a warm `pass` took 1.7 s to exit that way)."""
        interrupted = False
        try:
            code = _exit_code(self.body())
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code, interrupted = 1, True
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            if interrupted:  # as Python 3.8+ ends after an uncaught KeyboardInterrupt: killed by SIGINT
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def _exit_code(code: object) -> int:
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def send(sock: socket.socket, message: ForkServerMessage) -> None:
    sock.sendall(_encoder.encode(message))


class Server:
    """The loop: fork on request, reap and report children."""

    def __init__(self, sock: socket.socket, baseline: dict[str, str]) -> None:
        self.sock, self.baseline = sock, baseline
        self.children: dict[int, int] = {}  # a child's pidfd -> its pid
        self.pid = os.getpid()
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.refusal: str | None = None  # why every request is refused, once forking is unsafe

    def reap(self, *_: object) -> None:
        """Report the children that have ended (SIGCHLD's handler while we import: an import holds the loop)."""
        self._reap({fd for fd, _ in self.poll.poll(0)})

    def _reap(self, readable: set[int]) -> None:
        for fd in readable & self.children.keys():  # a child ended: reap it, and tell the agent how
            pid = self.children.pop(fd)
            self.poll.unregister(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            send(self.sock, ChildExited(pid=pid, code=os.waitstatus_to_exitcode(status)))

    def serve(self) -> int | Child:
        """Until the agent closes its end: 0 then, or in a forked child the Child to run."""
        while (result := self.step(None)) is None:
            pass
        return result

    def step(self, timeout_ms: int | None) -> int | Child | None:
        """Handle what is ready within `timeout_ms` (None: wait); None to go on, else what `serve` returns."""
        readable = {fd for fd, _ in self.poll.poll(timeout_ms)}
        self._reap(readable)
        if self.sock.fileno() not in readable:
            return None
        try:
            message, fds, flags, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 2)
        except ConnectionResetError:
            return 0
        if not message:
            return 0  # the agent is going away (its children die with us)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("request truncated")
            request = FORK_REQUEST_DECODER.decode(message)
            wanted = 1 if request.assignment is not None else 2
            if len(fds) != wanted:
                raise ValueError(f"{len(fds)} descriptors attached, {wanted} expected")
            if self.refusal is not None:
                raise ValueError(self.refusal)
        except (ValueError, msgspec.DecodeError) as exc:
            for fd in fds:
                os.close(fd)
            send(self.sock, ForkRefused(reason=str(exc)))
            return None
        pid = os.fork()
        if pid == 0:
            return child(request, fds, self.sock, list(self.children), self.pid, self.baseline)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poll.register(pidfd, select.POLLIN)
        send(self.sock, Forked(pid=pid))
        return None


def child(request: ForkRequest, fds: list[int], sock: socket.socket, pidfds: list[int], server: int,
          baseline: dict[str, str]) -> Child:
    """Set a fresh child up as a process of its own; it never returns into the server's loop."""
    try:
        sock.close()
        for fd in pidfds:
            os.close(fd)
        os.setsid()  # its own session, as the agent starts every rank: a signal to the group reaches all it starts
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server:  # the server died before prctl took effect
            os._exit(1)
        _reseed()
        assignment = request.assignment
        if assignment is not None:
            out = fds[0]
            return Child(lambda: become(assignment, out, baseline, warm=True))
        log_fd, standby_fd = fds
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        standby = socket.socket(fileno=standby_fd)
        standby.setblocking(True)
        return Child(lambda: wait_and_become(standby, baseline, warm=True))
    except BaseException:  # never back into the server's loop
        with contextlib.suppress(Exception):
            traceback.print_exc()
        os._exit(1)


def _reseed() -> None:
    """Give the child the fresh randomness a process started cold has (Python's `random` reseeds itself at fork;
    numpy's global generator, seeded once at import, does not). torch's default seed is a constant either way."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _preload_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preload", default="", metavar="MODULES",
                   help="comma-separated modules to import after the trainer's: the jobs' own libraries")


def import_between_requests(server: Server, names: Sequence[str], *, stop_at_failure: bool) -> int | Child | None:
    """Import `names` one by one, serving requests between them (an import holds the loop for up to a second); a
    failed import is printed, and ends the imports if `stop_at_failure`. None, or what `Server.step` returned."""
    for name in names:
        signal.signal(signal.SIGCHLD, server.reap)  # the self-check's exit is its verdict: tell it at once
        try:
            importlib.import_module(name)
        except Exception:  # the ranks import it themselves and show the failure in their own logs
            traceback.print_exc()
            if stop_at_failure:
                break
        finally:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # children are forked without it
        if (result := server.step(0)) is not None:
            return result
    return None


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def main(argv: list[str] | None = None) -> int | Child:
    sock, args = agent_socket("python -m flightdeck.trainer.forkserver", __doc__, argv, _preload_option)
    preload = [name for name in args.preload.split(",") if name]
    baseline = dict(os.environ)
    started = time.perf_counter()
    if not warm_up("fork server (torch)", BASE_MODULES):
        return 1  # the agent starts its processes cold; their logs show the same failure
    try:
        send(sock, ServerReady(warmup_s=round(time.perf_counter() - started, 3), complete=False))
        gc.freeze()  # what is imported so far stays out of the children's collections (they would copy its pages)
        server = Server(sock, baseline)
        # The agent asks for its self-check at once: fork it before the next import holds us for a second.
        if (result := server.step(SELFCHECK_WAIT_MS)) is not None:
            return result
        # The rest between requests: the self-check runs meanwhile.
        rest = [m for m in WARM_MODULES if m not in BASE_MODULES]
        if (result := import_between_requests(server, rest, stop_at_failure=True)) is not None:
            return result
        if (result := import_between_requests(server, preload, stop_at_failure=False)) is not None:
            return result
        if cuda_initialised():  # a child of ours could not use the GPU: every fork is refused, ranks start cold
            preloaded = ", ".join(preload) or "none"
            server.refusal = (f"an import initialised CUDA in the fork server (preloaded: {preloaded}); its children "
                              f"could not use the GPU")
            print(f"fork server {os.getpid()}: {server.refusal}; refusing to fork", flush=True)
        gc.freeze()
        warmup_s = round(time.perf_counter() - started, 3)
        print(f"fork server {os.getpid()} ready: imports took {warmup_s:.2f}s", flush=True)
        send(sock, ServerReady(warmup_s=warmup_s, complete=True))
    except OSError:
        return 0  # the agent went away while we warmed up
    return server.serve()


if __name__ == "__main__":
    result = main()
    if isinstance(result, Child):
        result.run()
    sys.exit(result)
