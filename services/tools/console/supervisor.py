"""A small process manager: start named processes, log each to its own file, restart the ones that
die with capped exponential backoff, and stop them all (SIGTERM, then SIGKILL after a grace period).

It is synchronous on purpose: `step()` does one round of bookkeeping and the caller owns the loop,
so `flightdeck up` can interleave it with watching the broker and handling signals.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("flightdeck.supervisor")


@dataclass(frozen=True)
class ProcessSpec:
    """One supervised process: a name (also its log file's name) and the command that runs it."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the supervisor's environment


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th consecutive restart: initial * factor**(n-1), at most `max_s`. A process
    that stayed up `reset_after_s` counts as healthy again, so its next crash restarts quickly."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 10.0

    def delay(self, failures: int) -> float:
        return float(min(self.max_s, self.initial_s * self.factor ** max(failures - 1, 0)))


@dataclass
class Child:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive exits without staying up reset_after_s
    restarts: int = 0
    next_start_at: float = 0.0
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: on Linux, ask for SIGTERM when the supervisor dies, so a
    SIGKILLed supervisor leaves no orphans behind."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        log_dir: Path,
        *,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        names = [s.name for s in specs]
        assert len(set(names)) == len(names), f"process names must be unique: {names}"
        self.log_dir = log_dir
        self.backoff = backoff
        self._clock = clock
        self._on_change = on_change
        self.children = [Child(spec, log_dir / f"{spec.name}.log") for spec in specs]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children:
            self._spawn(child)
        self._on_change()

    def step(self) -> None:
        """Notice exits, schedule restarts, and start what is due."""
        now = self._clock()
        changed = False
        for child in self.children:
            if child.proc is not None and (code := child.proc.poll()) is not None:
                changed = True
                self._exited(child, code, now)
            if child.proc is None and now >= child.next_start_at:
                changed = True
                child.restarts += 1
                self._spawn(child)
        if changed:
            self._on_change()

    def pids(self) -> dict[str, int | None]:
        return {c.spec.name: c.pid for c in self.children}

    def running_for(self, seconds: float) -> bool:
        """True when every process is alive and has been for at least `seconds`."""
        now = self._clock()
        return all(c.pid is not None and now - c.started_at >= seconds for c in self.children)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process, wait up to `grace_s` for all of them, then SIGKILL the rest."""
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            assert child.proc is not None
            child.proc.terminate()
        deadline = time.monotonic() + grace_s
        for child in running:
            assert child.proc is not None
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                log.warning("process ignored SIGTERM, killing", name=child.spec.name, pid=child.proc.pid)
                child.proc.kill()
                child.proc.wait()
            self._note(child, f"stopped (exit code {child.proc.returncode})")
        for child in self.children:
            child.proc = None
        self._on_change()

    def _spawn(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.spec.env}
        self._note(child, f"starting: {' '.join(child.spec.argv)}")
        with open(child.log_path, "ab") as out:
            child.proc = subprocess.Popen(
                child.spec.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                # Its own session: a Ctrl-C in the terminal reaches only the supervisor, which then
                # stops everything in order instead of every process dying at once.
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        child.started_at = self._clock()
        # The first start is in `up`'s own banner; restarts are news.
        (log.info if child.restarts else log.debug)("process started", name=child.spec.name, pid=child.proc.pid,
                                                     restarts=child.restarts)

    def _exited(self, child: Child, code: int, now: float) -> None:
        if now - child.started_at >= self.backoff.reset_after_s:
            child.failures = 0
        child.failures += 1
        delay = self.backoff.delay(child.failures)
        child.last_exit = code
        child.proc = None
        child.next_start_at = now + delay
        self._note(child, f"exited with code {code}; restarting in {delay:.1f}s")
        log.warning("process exited", name=child.spec.name, exit_code=code, restart_in_s=delay,
                    failures=child.failures)

    def _note(self, child: Child, line: str) -> None:
        """A supervisor line in the process's own log, so restarts are visible where its output is."""
        with open(child.log_path, "a") as out:
            out.write(f"--- flightdeck {time.strftime('%Y-%m-%dT%H:%M:%S')}: {child.spec.name} {line}\n")
