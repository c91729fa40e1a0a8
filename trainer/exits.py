"""How a rank's process ends: the hook that records an uncaught exception, and the exit code that tells the platform
whether every step ran (0 only then: events/nodelocal.py STOPPED_EXIT)."""

import contextlib
import os
import sys
import time
from typing import Any

import structlog

from flightdeck.events.commands import StopRequested
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.training import RankFault
from flightdeck.trainer.session import Run
from flightdeck.trainer.usage import is_refusal

log = structlog.get_logger("trainer")


# A peer's death breaks every collective it was in: this is how torch says so on the ranks that survive it.
PEER_GONE = ("This is typically caused by a remote worker crashing", "Connection closed by peer",
             "Connection reset by peer", "NCCL communicator was aborted")
PEER_STOP_WAIT_S = 15.0  # for the platform's stop, after a collective broke under a surviving rank


def peer_broke(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another rank went away (not this rank's fault)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(sign in text for sign in PEER_GONE)


def stopped_with_job(run: Run, wait_s: float = PEER_STOP_WAIT_S) -> bool:
    """Whether the platform stops this attempt within `wait_s`: a StopRequested down the link, a SIGTERM from the
    agent, or the agent gone. The scheduler decides on the peer's exit in well under a second."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if run.sigterm or run.inbox.gone or any(isinstance(c, StopRequested) for c in run.inbox.poll()):
            return True
        time.sleep(0.05)
    return False


def fail_hook(run: Run) -> Any:
    """A sys.excepthook that records an uncaught exception as RankFault before Python prints it. A survivor whose
    collective broke because a peer died is not failed: once the platform stops the job it exits as stopped, saying
    so in a line, instead of a traceback that read as a second failure in `flightdeck logs`."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        text = f"{kind.__name__}: {exc}"
        if not run.closed and run.last is not None:  # raised before the optimizer's step: its boundary still holds
            run.last.take("a peer's failure broke this rank's collective" if peer_broke(exc) else
                          f"{kind.__name__} raised in the step")
        if not run.closed and run.cfg.platform and peer_broke(exc) and stopped_with_job(run):
            log.warning("stopping with the job: a peer of this rank failed and broke the collective it was in; not "
                        "a fault of this rank", step=run.step, error=text.splitlines()[0][:300])
            run.finished, run.stopped, run.closed = False, True, True
            run.emitter.close()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(STOPPED_EXIT)
        if not run.closed:
            usage = is_refusal(exc)
            run.emitter.emit(RankFault(kind="cuda" if "CUDA" in text else "exception", error_type=kind.__name__,
                                       message=str(exc)[:4000], step=run.step, usage=usage,
                                       **run.emitter.envelope, schema_version=2 if usage else 1))
            run.finished = False
            run.failed = True
            run.closed = True  # do not wait on a checkpoint write or collectives of a failed rank at exit
            run.emitter.close()
        previous(kind, exc, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        # Now, not after the interpreter's teardown (seconds with torch loaded): a rank that stopped
        # heartbeating but has not exited would be reported lost before its exit and traceback land.
        os._exit(1)

    return hook


def at_exit(run: Run) -> None:
    """`init()` runs this at the interpreter's exit: close, and if `steps()` was left before its last step
    (a `break`, or `sys.exit(0)` inside the loop) exit with STOPPED_EXIT whatever the script's code was,
    since an exit 0 reads to the platform as "every step ran"."""
    run.close()
    if run.stepping and not run.ran_all and not run.failed and not run.stopped:
        log.warning("the script left run.steps() before its last step: exiting as stopped, not completed",
                    step=run.step, code=STOPPED_EXIT)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(STOPPED_EXIT)
