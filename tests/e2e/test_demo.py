"""`make demo` end to end: the whole platform on this machine (broker, services, a node agent, two real CPU
ranks) runs the tiny drill; rank 1 crashes at step 100 and the job must still complete, after a restart."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.console import upstate

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 230  # the job itself takes ~30 s on an idle 2-core box; the rest is slack for a busy one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 150)]


def run_demo(data_dir: Path, log: Path) -> tuple[int, str]:
    """The demo's exit code and output. On a timeout it is terminated (it then stops what it started), and
    `down` runs in any case, so no broker or rank outlives the test."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.console.demo", "--data-dir", str(data_dir),
                                 "--timeout-s", str(TIMEOUT_S - 60)], stdout=out, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT)
        try:
            proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            subprocess.run([sys.executable, "-m", "services.console", "down", "--data-dir", str(data_dir)],
                           capture_output=True, timeout=60, cwd=ROOT)
    return proc.returncode, log.read_text()


def test_the_demo_drill_completes_after_a_restart_and_stops_everything(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo"
    started = time.monotonic()
    code, out = run_demo(data_dir, tmp_path / "demo.out")
    assert code == 0, out
    timeline = out.split("live (times from submission):")[1].split("$ flightdeck status")[0]
    labels = [line.split()[1] for line in timeline.splitlines() if re.match(r"\s+[\d.]+s\s", line)]
    # the drill's story, in order: placed, running, the injected crash, the restart, resumed, completed
    story = ["submitted", "running", "fault", "recovering", "running", "resumed", "completed"]
    it = iter(labels)
    assert all(label in it for label in story), labels
    assert "crash injected on rank 1 at step 100 (drill)" in timeline
    # The restart resumes from the newest checkpoint committed when it was placed: at least the newest one
    # before the crash was handled, at most the newest before it resumed (a commit lands about a second after
    # its step, so the step-80 one may commit before, during or after the restart).
    committed: list[int] = []
    floor, resumed_from = -1, -1
    for line in timeline.splitlines():
        if found := re.search(r"checkpoint +step (\d+) committed", line):
            committed.append(int(found[1]))
        elif re.search(r"\ds  recovering ", line):
            floor = max(committed, default=0)
        elif found := re.search(r"resumed +from \S+ at step (\d+), world size 2", line):
            resumed_from = int(found[1])
            assert 0 <= floor <= resumed_from <= max(committed, default=0) <= 100, timeline
            assert resumed_from in (0, *committed), timeline
    assert resumed_from >= 0, timeline
    assert re.search(r"phase: +completed\n", out)
    assert re.search(rf"restarts: +1 of 3, resumed from step {resumed_from}\n", out)
    assert re.search(r"steps: +160/160 done", out)
    assert "step000000160-a1   160" in out  # the final checkpoint, from attempt 1, listed by `checkpoints`
    assert "flightdeck stopped: supervisor pid" in out and "demo done in" in out
    assert not (data_dir / "up.json").exists() and not upstate.lock_held(data_dir)  # nothing is left running
    assert time.monotonic() - started < TIMEOUT_S
