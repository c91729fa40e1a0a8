"""The process supervisor with real child processes: tiny python sleepers and crashers."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flightdeck.services.tools.console.supervisor import Backoff, ProcessSpec, Supervisor

pytestmark = pytest.mark.timeout(30)

SLEEPER = (sys.executable, "-c", "import time; print('hello from the sleeper', flush=True); time.sleep(60)")
CRASHER = (sys.executable, "-c", "import sys; print('crashing', flush=True); sys.exit(3)")
STUBBORN = (sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ignoring SIGTERM', flush=True); time.sleep(60)")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gone(pid: int) -> bool:
    """Exited: no such pid, or a zombie nobody reaped yet (in a container, pid 1 may never reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def output_lines(path: Path) -> list[str]:
    """What the process printed, without the supervisor's own `---` lines."""
    return [line for line in path.read_text().splitlines() if not line.startswith("---")]


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_backoff_grows_and_is_capped() -> None:
    b = Backoff(initial_s=0.5, factor=2.0, max_s=3.0)
    assert [b.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_crashing_process_is_restarted_with_growing_delays(tmp_path: Path) -> None:
    clock = FakeClock()
    sup = Supervisor([ProcessSpec("crasher", CRASHER)], tmp_path, clock=clock,
                     backoff=Backoff(initial_s=1.0, factor=2.0, max_s=4.0, reset_after_s=60.0))
    sup.start()
    child = sup.children[0]
    delays = []
    for _ in range(4):
        assert child.proc is not None
        child.proc.wait(10)
        sup.step()  # notices the exit, schedules the restart
        assert child.proc is None and child.last_exit == 3
        delay = child.next_start_at - clock.now
        delays.append(delay)
        clock.now += delay - 0.01
        sup.step()
        assert child.proc is None, "restarted before its backoff was over"
        clock.now += 0.02
        sup.step()
        assert child.proc is not None, "not restarted after its backoff"
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert child.restarts == 4
    child.proc.wait(10)  # type: ignore[union-attr]
    sup.stop()
    log = (tmp_path / "crasher.log").read_text()
    assert output_lines(tmp_path / "crasher.log") == ["crashing"] * 5
    assert "exited with code 3; restarting in 4.0s" in log


def test_backoff_resets_after_the_process_stayed_up(tmp_path: Path) -> None:
    clock = FakeClock()
    sup = Supervisor([ProcessSpec("crasher", CRASHER)], tmp_path, clock=clock,
                     backoff=Backoff(initial_s=1.0, factor=2.0, max_s=30.0, reset_after_s=10.0))
    sup.start()
    child = sup.children[0]
    for _ in range(3):  # three quick crashes: the next delay would be 8 s
        assert child.proc is not None
        child.proc.wait(10)
        sup.step()
        clock.now = child.next_start_at
        sup.step()
    assert child.failures == 3
    assert child.proc is not None
    child.proc.wait(10)
    clock.now += 10.0  # it "ran" for 10 s before this exit
    sup.step()
    assert child.failures == 1
    assert child.next_start_at - clock.now == 1.0
    sup.stop()


def test_restarts_in_real_time_and_logs_land_in_files(tmp_path: Path) -> None:
    sup = Supervisor([ProcessSpec("sleeper", SLEEPER), ProcessSpec("crasher", CRASHER)], tmp_path,
                     backoff=Backoff(initial_s=0.05, factor=2.0, max_s=0.2))
    sup.start()
    crasher = sup.children[1]
    wait_for(lambda: (sup.step(), crasher.restarts >= 3)[1])
    sup.stop()
    assert output_lines(tmp_path / "sleeper.log") == ["hello from the sleeper"]
    assert output_lines(tmp_path / "crasher.log").count("crashing") >= 3
    assert sup.children[0].restarts == 0


def test_stop_kills_every_process_even_one_that_ignores_sigterm(tmp_path: Path) -> None:
    sup = Supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER), ProcessSpec("stubborn", STUBBORN)],
                     tmp_path)
    sup.start()
    wait_for(lambda: output_lines(tmp_path / "stubborn.log") == ["ignoring SIGTERM"])
    pids = [p for p in sup.pids().values() if p is not None]
    assert len(pids) == 3
    started = time.monotonic()
    sup.stop(grace_s=0.5)
    # Killed after the 0.5 s grace, not after stop's default 10 s one: well under 10 s even on a loaded box.
    assert time.monotonic() - started < 8
    assert all(gone(p) for p in pids)
    assert sup.pids() == {"a": None, "b": None, "stubborn": None}
    assert "stopped (exit code -9)" in (tmp_path / "stubborn.log").read_text()


def test_running_for_needs_every_process_alive_long_enough(tmp_path: Path) -> None:
    clock = FakeClock()
    sup = Supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("crasher", CRASHER)], tmp_path, clock=clock)
    sup.start()
    assert not sup.running_for(1.0)
    clock.now += 2.0
    sup.children[1].proc.wait(10)  # type: ignore[union-attr]
    sup.step()
    assert not sup.running_for(1.0)
    sup.stop()
    sup2 = Supervisor([ProcessSpec("a", SLEEPER)], tmp_path, clock=clock)
    sup2.start()
    clock.now += 1.0
    assert sup2.running_for(1.0)
    sup2.stop()


def test_children_die_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from flightdeck.services.tools.console.supervisor import ProcessSpec, Supervisor\n"
        f"sup = Supervisor([ProcessSpec('sleeper', {SLEEPER!r})], Path({str(tmp_path)!r}))\n"
        "sup.start()\n"
        "print('PID', sup.pids()['sleeper'], flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child_pid = int(next(line for line in proc.stdout if line.startswith("PID")).split()[1])
    assert not gone(child_pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wait_for(lambda: gone(child_pid), timeout=5)
