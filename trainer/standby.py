"""A warm standby rank: a process that has already imported torch and the trainer, waiting for one assignment
from its node agent; it then becomes that rank exactly as `python -m flightdeck.trainer ...` (or an entrypoint job's
`python train.py ...`) would have run it.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import argparse
import contextlib
import importlib
import os
import runpy
import socket
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType

from flightdeck.events.nodelocal import ASSIGNMENT_DECODER, MAX_MESSAGE, READY, Assignment, acts_early

# Everything `python -m flightdeck.trainer` imports (trainer/__main__.py's imports and what they load on first use), but
# not flightdeck.trainer.__main__ itself: runpy warns when the module it runs as __main__ is already imported.
# torch._dynamo: torch.optim's Optimizer.__init__ imports it on first use (as much time again as `import torch`).
WARM_MODULES = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel",
                "flightdeck", *(f"flightdeck.trainer.{m}" for m in (
                    "config", "distributed", "link", "loop", "reports", "session", "checkpointing", "state", "model",
                    "data")))


def warm_target(a: Assignment, baseline: dict[str, str]) -> tuple[str, str] | None:
    """What to run in this warm interpreter: ("module", name) for `python -m name ...`, ("path", file) for
    `python file.py ...` (an entrypoint job's script), or None when `a` needs a cold start (see the docstring)."""
    if len(a.argv) < 2 or a.argv[0] != sys.executable:
        return None
    changed = {k for k in a.env.keys() | baseline.keys() if a.env.get(k) != baseline.get(k)}
    if any(acts_early(k) for k in changed):
        return None
    if a.argv[1] == "-m" and len(a.argv) >= 3:
        if os.path.realpath(a.cwd) != os.path.realpath(os.getcwd()):
            return None  # sys.path[0] is the directory the standby started in
        return "module", a.argv[2]
    if a.argv[1].endswith(".py") and not a.argv[1].startswith("-"):
        return "path", a.argv[1]  # interpreter options (-u, -X ...) start cold: they act before any import
    return None


def become(a: Assignment, log_fd: int, baseline: dict[str, str], warm: bool) -> int:
    """Turn this process into the assigned rank; returns its exit code (or never returns: exec, sys.exit)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    target = warm_target(a, baseline) if warm else None
    os.chdir(a.cwd)
    if target is None:
        os.execve(a.argv[0], a.argv, a.env)
    os.environ.clear()
    os.environ.update(a.env)
    sys.excepthook = from_the_script(sys.excepthook)
    kind, name = target
    if kind == "module":
        sys.argv = [a.argv[0], *a.argv[3:]]  # runpy puts the module's file in sys.argv[0], as `python -m` does
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        # As `python file.py`: argv from the script on, and the script's own directory first on sys.path.
        sys.argv = a.argv[1:]
        sys.path[0] = os.path.dirname(os.path.realpath(name))
        runpy.run_path(name, run_name="__main__")
    return 0  # a script that returns without sys.exit() ends like `python` would: 0


# The frames above a warm rank's own code: its traceback starts at its code, as a cold start's does.
_LAUNCHERS = frozenset({"<frozen runpy>", os.path.realpath(runpy.__file__), os.path.realpath(__file__),
                        os.path.join(os.path.dirname(os.path.realpath(__file__)), "forkserver.py")})


def from_the_script(hook: Callable[[type[BaseException], BaseException, TracebackType | None], object]) \
        -> Callable[[type[BaseException], BaseException, TracebackType | None], None]:
    """`hook` shown only the frames from the rank's code on: without the standby's and runpy's frames, which a
    cold `python train.py` never had (they pushed the rank's last printed lines out of its exit's cause)."""
    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        start = tb
        while start is not None and _launcher(start.tb_frame.f_code.co_filename):
            start = start.tb_next
        start = start if start is not None else tb
        hook(kind, value.with_traceback(start), start)  # the default hook shows the exception's own traceback
    return excepthook


def _launcher(filename: str) -> bool:
    return filename in _LAUNCHERS or os.path.realpath(filename) in _LAUNCHERS


def receive(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """The assignment (b"" once the agent retires us). An agent that closes its end with our READY still unread
    makes the first read fail with ECONNRESET although the assignment is queued behind it: read again. Taken for
    the agent going away, it lost the rank, which exited 0 unseen (bench/vs_peers.py caught the stuck job)."""
    try:
        message, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    except ConnectionResetError:
        message, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    return message, fds, flags


def warm_up(who: str, modules: tuple[str, ...] = WARM_MODULES) -> bool:
    """Import everything a rank imports; False if that failed (the rank then starts cold and shows why)."""
    started = time.perf_counter()
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:
        traceback.print_exc()
        return False
    print(f"{who} {os.getpid()} ready: imports took {time.perf_counter() - started:.2f}s", flush=True)
    return True


def wait_and_become(sock: socket.socket, baseline: dict[str, str], warm: bool) -> int:
    """Say READY on `sock`, wait for the one assignment, and become that rank (the code it exits with)."""
    with contextlib.suppress(OSError):  # an assignment sent before we were ready closed the agent's end already
        sock.sendall(READY)
    try:
        message, fds, flags = receive(sock)
    except OSError:  # the agent went away (it would have killed us with it): nothing was assigned
        return 0
    finally:
        sock.close()
    if not message:
        return 0  # retired
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 1:
        print(f"standby {os.getpid()}: assignment truncated or with {len(fds)} descriptors, not 1", file=sys.stderr)
        return 2
    return become(ASSIGNMENT_DECODER.decode(message), fds[0], baseline, warm)


def agent_socket(prog: str, doc: str | None, argv: list[str] | None,
                 options: Callable[[argparse.ArgumentParser], object] | None = None,
                 ) -> tuple[socket.socket, argparse.Namespace]:
    """The command line's `--fd`: this end of the agent's SOCK_SEQPACKET pair, blocking; and the other `options`."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fd", type=int, required=True, help="this end of the agent's SOCK_SEQPACKET socket pair")
    if options is not None:
        options(p)
    args = p.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    return sock, args


def main(argv: list[str] | None = None) -> int:
    sock, _ = agent_socket("python -m flightdeck.trainer.standby", __doc__, argv)
    baseline = dict(os.environ)
    return wait_and_become(sock, baseline, warm_up("standby"))


if __name__ == "__main__":
    sys.exit(main())
