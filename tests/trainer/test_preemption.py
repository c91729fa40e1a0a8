"""SIGTERM is preemption: every rank checkpoints at the same agreed boundary, then exits STOPPED_EXIT (never 0,
which says every step ran); a script that leaves run.steps() early exits the same way."""

import signal
from pathlib import Path

import pytest

from flightdeck.events.nodelocal import STOPPED_EXIT
from tests.trainer import ranks

pytestmark = pytest.mark.timeout(300)  # hang guards: each test starts ranks (torch) on a loaded box


def test_sigterm_saves_then_exits_as_stopped_not_finished(tmp_path: Path) -> None:
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, train={"steps": 100_000, "checkpoint_every": 100_000})
    log = tmp_path / "events.jsonl"
    with ranks.started(tmp_path, spec, world=2, args=("--sync-every", "4")) as procs:
        ranks.wait_for(lambda: len(ranks.events(log, "StepCompleted", 1)) >= 3, ranks.RUN_TIMEOUT_S, "steps")
        procs[1].send_signal(signal.SIGTERM)  # one rank told is enough: the flag is agreed like a command
        # Trial 1 (86ea31b): both exited 0 here, and the scheduler completed the job at 27%.
        assert ranks.wait(procs, ranks.RUN_TIMEOUT_S) == [STOPPED_EXIT] * 2, ranks.log_tail(tmp_path, 2)
    staged = ranks.events(log, "CheckpointStaged")
    assert sorted(e["rank"] for e in staged) == [0, 1]
    (step,) = {e["step"] for e in staged}
    assert step % 4 == 0
    for rank in (0, 1):
        assert ranks.events(log, "StepCompleted", rank)[-1]["step"] == step - 1  # saved where it stopped
    ckpt = tmp_path / "staging" / "job-1" / f"step-{step}"
    files = sorted(s["path"] for e in staged for s in e["shards"])
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all((ckpt / f).stat().st_size > 0 for f in files)
