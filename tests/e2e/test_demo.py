"""`make demo` end to end: the whole platform on this machine (broker, services, a node agent, two real CPU
ranks) runs examples/demo.toml: a loss spike and then a crash in attempt 0, a hang in attempt 1. The job must
complete by itself: the spike rolled back in place with a skip window, the crash and the hang each restarted,
and the restart after the rollback resumed on the rolled-back timeline."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flightdeck.services.tools.console import upstate

ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")
DEMO = (sys.executable, "-m", "flightdeck.services.tools.console.demo")
STANDBY_ENV = "FLIGHTDECK_STANDBY"  # flightdeck.services.agent.main's (not imported: it pulls in the agent)
TIMEOUT_S = 300  # the job takes about a minute on an idle 2-core box; the rest is slack for a busy one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 150)]


def run_demo(data_dir: Path, log: Path) -> tuple[int, str]:
    """The demo's exit code and output. On a timeout it is terminated (it then stops what it started), and
    `down` runs in any case, so no broker or rank outlives the test."""
    # As `make demo` runs: the agents' default of warm standbys, whatever the suite was told (tests/conftest.py).
    env = {k: v for k, v in os.environ.items() if k != STANDBY_ENV}
    with open(log, "w") as out:
        proc = subprocess.Popen([*DEMO, "--data-dir", str(data_dir),
                                 "--timeout-s", str(TIMEOUT_S - 60)], stdout=out, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT, env=env)
        try:
            proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            subprocess.run([*CLI, "down", "--data-dir", str(data_dir)],
                           capture_output=True, timeout=60, cwd=ROOT)
    return proc.returncode, log.read_text()


def incident(summary: str, n: int) -> dict[str, str]:
    """Incident `n` of the printed summary: its fault line, and its detected/decided/resumed/reports/cost lines."""
    block = re.search(rf"^  {n}\. (.*?)(?=^  \d+\. |^  completed |\Z)", summary, re.M | re.S)
    assert block, summary
    lines = block[1].splitlines()
    out = {"fault": lines[0]}
    for line in lines[1:]:
        label, _, rest = line.strip().partition(" ")
        out[label] = rest.strip()
    return out


def test_the_demo_drill_heals_a_spike_a_crash_and_a_hang_and_completes(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo"
    started = time.monotonic()
    code, out = run_demo(data_dir, tmp_path / "demo.out")
    assert code == 0, out
    timeline = out.split("live (times from submission):")[1].split("incidents (times from submission")[0]
    labels = [line.split()[1] for line in timeline.splitlines() if re.match(r"\s+[\d.]+s\s", line)]
    # a restart's JobResumed comes with the record that its attempt runs, one line before it
    story = ["submitted", "running", "fault", "finding", "rollback", "rolled", "fault", "recovering", "resumed",
             "running", "fault", "finding", "recovering", "resumed", "running", "completed"]
    it = iter(labels)
    if not all(label in it for label in story):  # the whole timeline, which an assert's message would cut short
        pytest.fail(f"the timeline does not tell {' '.join(story)} in this order:\n{timeline}", pytrace=False)
    assert "did not end" not in out, out
    rows = [line for line in timeline.splitlines() if re.match(r"\s+[\d.]+s\s", line)]
    times = [float(line.split()[0].removesuffix("s")) for line in rows]
    assert times == sorted(times), rows  # the two streams' lines in time order
    assert any(r.split()[1] == "pacing" and "not a fault" in r for r in rows), rows  # the slow "fault" explained

    summary = out.split("incidents (times from submission; + is time since the fault):")[1].split("$ flightdeck")[0]
    spike, crash, hang = (incident(summary, n) for n in (1, 2, 3))
    assert "  4. " not in summary, summary  # the postmortem's incidents: one per fault
    assert spike["fault"].startswith("loss_spike: drill fault 'loss_spike' injected at step 40 on rank 0 (attempt 0)")
    assert "LossSpikeDetected:" in spike["detected"], summary
    rollback = re.search(r"rollback: roll back to (\S+) \(step (\d+)\), skip batches \[(\d+), (\d+)\)$",
                         spike["decided"])
    assert rollback and int(rollback[2]) <= 35 and int(rollback[3]) <= 42 < 45 <= int(rollback[4]), summary
    assert re.search(rf"back at step {rollback[2]} after ", spike["resumed"]), summary
    assert spike["cause"].startswith("data (re-run "), summary  # its batches spiked again; skipping them healed it

    assert crash["fault"].startswith("crash: drill fault 'crash' injected at step 90 on rank 1 (attempt 0)"), summary
    assert "exited with code 3" in crash["detected"] or "RankLost" in crash["detected"], summary
    assert "RankLost" in crash["reports"], summary
    # the restart resumes on the rolled-back timeline: a checkpoint redone after the rollback, or its target
    restart = re.search(r"restart: restart as attempt 1 from step (\d+) \(([^)\s]+)\)", crash["decided"])
    assert restart and (restart[2].endswith("-a0-t1") or restart[2] == rollback[1]), summary
    assert crash["resumed"].endswith(f"resumed at step {restart[1]}"), summary

    assert hang["fault"].startswith("hang: drill fault 'hang' injected at step 120 on rank 0 (attempt 1)"), summary
    assert hang["detected"].split()[2] == "RankHung:", summary
    # the newest commit the restart knew of or waited for: 110 or 120 as a rule; 100 on a box loaded enough that the
    # broker stalled for seconds and the later sets were announced only after the restart's commit landed
    assert re.search(r"restart: restart as attempt 2 from step 1[0-2]0 \(step0+1[0-2]0-a1\)", hang["decided"]), summary
    assert re.search(r"resumed at step 1[0-2]0$", hang["resumed"]), summary
    assert "completed 160 steps" in summary

    assert re.search(r"phase: +completed\n", out)
    assert re.search(r"restarts: +2 of 3, resumed from step 1[0-2]0\n", out)
    assert re.search(r"steps: +160/160 done", out)
    assert re.search(r"step000000160-a2 +160 ", out)  # the final checkpoint, from attempt 2, listed by `checkpoints`

    # `curl /metrics` on the URL the demo printed shows the job's figures, agreeing with the summary above
    job = re.search(r"the dashboard shows it live: (http://\S+)/\?job=(\S+)\n", out)
    assert job, out
    scraped = out.split(f"$ curl -s {job[1]}/metrics")[1].split("\n$ ")[0].split("\n\n")[0]
    metrics = dict(line.strip().rsplit(" ", 1) for line in scraped.splitlines()[1:])
    j = f'job_id="{job[2]}"'
    assert metrics.pop(f'flightdeck_job_phase{{{j},phase="completed"}}') == "1", scraped
    assert metrics.pop(f"flightdeck_job_step{{{j}}}") == "160", scraped
    assert metrics.pop(f"flightdeck_job_restarts_total{{{j}}}") == "2", scraped
    assert metrics.pop(f"flightdeck_job_rollbacks_total{{{j}}}") == "1", scraped
    for kind in ("loss_spike", "crash", "hang"):
        assert metrics.pop(f'flightdeck_job_incidents_total{{{j},kind="{kind}"}}') == "1", scraped
    assert 0 < float(metrics.pop(f"flightdeck_job_goodput_ratio{{{j}}}")) <= 1, scraped
    committed = re.search(r"demo done in .*, (\d+) checkpoints committed", out)
    assert committed, out  # every commit is in the histogram: as many as the history's committed checkpoints
    assert metrics.pop(f"flightdeck_checkpoint_commit_seconds_count{{{j}}}") == committed[1], scraped
    assert metrics == {}, scraped  # no other incident kind, nothing unparsed
    assert "flightdeck stopped: supervisor pid" in out and "demo done in" in out
    assert not (data_dir / "up.json").exists() and not upstate.lock_held(data_dir)  # nothing is left running
    assert time.monotonic() - started < TIMEOUT_S
