"""Where a running process waits, on demand: SIGUSR1 writes every thread's Python stack to stderr (faulthandler,
which works even while the event loop is blocked) and logs every asyncio task's await chain (from the loop, once
it is free). Why: a process that hangs on a loaded CI box says in its own log where it waits, with no debugger."""

import asyncio
import faulthandler
import signal
import sys
from types import CoroutineType
from typing import Any

import structlog

log = structlog.get_logger("flightdeck.stacks")

DUMP_SIGNAL = signal.SIGUSR1


def dump_on_signal(loop: asyncio.AbstractEventLoop) -> None:
    """Install the dump for this process; call it from inside the running loop, before anything else claims
    SIGUSR1."""
    loop.add_signal_handler(DUMP_SIGNAL, log_tasks)
    # Registered after the loop's handler and chained to it: faulthandler dumps the threads at once, in the
    # signal handler, then hands the signal on to the loop, which logs the tasks when it next runs.
    if _has_fileno(sys.stderr):
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=True)


def log_tasks() -> None:
    """Log each pending asyncio task of the running loop with where it waits."""
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    for task in tasks:
        log.warning("task waiting", task=task.get_name(), awaiting=awaiting_chain(task))
    log.warning("tasks dumped", tasks=len(tasks))


def awaiting_chain(task: "asyncio.Future[Any]") -> list[str]:
    """Where a pending task waits: each coroutine down its await chain as `file:line function`, then the type
    of what the innermost one awaits (a future's await iterator does not show the future). `Task.get_stack`
    gives only the outermost frame of a suspended coroutine."""
    chain: list[str] = []
    awaited: object = task.get_coro() if isinstance(task, asyncio.Task) else task
    for _ in range(64):  # a bound, should a chain ever loop
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if not isinstance(awaited, CoroutineType) and frame is None:
            break
        if frame is not None:
            chain.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        if awaited is None:
            return chain
    chain.append(type(awaited).__name__)
    return chain


def _has_fileno(stream: object) -> bool:
    try:
        stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    return True
