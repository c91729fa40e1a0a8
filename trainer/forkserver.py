"""A node's fork server: one process that imports torch and the trainer once, then forks the node's warm standbys
and its self-check from itself. Each then costs a fork (milliseconds) instead of an interpreter start and
`import torch` (about 3 CPU-seconds on CPU, most of a restart's CPU on a small node).

    python -m trainer.forkserver --fd K      (started by the node agent: services/agent/forkserver.py)

Over the agent's SOCK_SEQPACKET pair (messages: events/nodelocal.py) we say ServerReady once warm, answer each
ForkRequest with Forked(pid) (or ForkRefused) in order, and send ChildExited when a child ends: we are its parent,
so only we can read its exit status. A child is in a session of its own and dies with us (PR_SET_PDEATHSIG), as we
die with the agent; it then runs as trainer/standby.py would, or becomes its assignment at once.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import argparse
import contextlib
import ctypes
import importlib
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

import msgspec

from events.nodelocal import (
    FORK_REQUEST_DECODER,
    MAX_MESSAGE,
    ChildExited,
    Forked,
    ForkRefused,
    ForkRequest,
    ForkServerMessage,
    ServerReady,
)
from trainer.standby import WARM_MODULES, become, wait_and_become, warm_up

PR_SET_PDEATHSIG = 1
# What the node's self-check needs (trainer/selfcheck.py): the server says so once these are in, and forks the
# check while it imports the rest, so the node registers as soon as it did with a check started cold.
BASE_MODULES = ("torch", "torch.distributed", "torch.multiprocessing")
_encoder = msgspec.msgpack.Encoder()


class Child:
    """What a forked child runs once it has left the server's loop: it unwinds to `__main__`, so it ends as a
    process started cold would (atexit handlers, non-daemon threads joined, buffers flushed)."""

    def __init__(self, run: Callable[[], int]) -> None:
        self.run = run


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

    def serve(self) -> int | Child:
        """Until the agent closes its end: 0 then, or in a forked child the Child to run."""
        while (result := self.step(None)) is None:
            pass
        return result

    def step(self, timeout_ms: int | None) -> int | Child | None:
        """Handle what is ready within `timeout_ms` (None: wait); None to go on, else what `serve` returns."""
        readable = {fd for fd, _ in self.poll.poll(timeout_ms)}
        for fd in readable & self.children.keys():  # a child ended: reap it, and tell the agent how
            pid = self.children.pop(fd)
            self.poll.unregister(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            send(self.sock, ChildExited(pid=pid, code=os.waitstatus_to_exitcode(status)))
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


def main(argv: list[str] | None = None) -> int | Child:
    p = argparse.ArgumentParser(prog="python -m trainer.forkserver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fd", type=int, required=True, help="this end of the agent's SOCK_SEQPACKET socket pair")
    args = p.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    baseline = dict(os.environ)
    started = time.perf_counter()
    if not warm_up("fork server (torch)", BASE_MODULES):
        return 1  # the agent starts its processes cold; their logs show the same failure
    try:
        send(sock, ServerReady(warmup_s=round(time.perf_counter() - started, 3), complete=False))
        server = Server(sock, baseline)
        # The rest between requests: the node's self-check, asked for as the agent starts, runs meanwhile.
        for name in (m for m in WARM_MODULES if m not in BASE_MODULES):
            try:
                importlib.import_module(name)
            except Exception:  # the ranks import it themselves and show the failure in their own logs
                traceback.print_exc()
                break
            if (result := server.step(0)) is not None:
                return result
        warmup_s = round(time.perf_counter() - started, 3)
        print(f"fork server {os.getpid()} ready: imports took {warmup_s:.2f}s", flush=True)
        send(sock, ServerReady(warmup_s=warmup_s, complete=True))
    except OSError:
        return 0  # the agent went away while we warmed up
    return server.serve()


if __name__ == "__main__":
    result = main()
    sys.exit(result.run() if isinstance(result, Child) else result)
