"""Real ranks on CPU: two ranks learn; a restore continues bitwise; a reshard continues the same stream."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flightdeck.events import nodelocal as nl
from flightdeck.events.nodelocal import RESTORE_REFUSED_EXIT
from tests.trainer import ranks

STEPS = 30
SAVE_AT = 15
# A resharded run sums gradients in another order (one 8-sequence batch vs two 4-sequence slices and an
# all-reduce), so it matches the 2-rank run to float32 rounding, not bitwise: measured 1.6e-7 relative
# 15 steps on.
RESHARD_RTOL = 1e-5


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run that checkpoints at step 15 (and 30)."""
    tmp = tmp_path_factory.mktemp("baseline")
    spec = ranks.write_spec(tmp / "job.toml", slots=2, train={"steps": STEPS, "checkpoint_every": SAVE_AT})
    codes = ranks.run(tmp, spec, world=2)
    assert codes == [0, 0], ranks.log_tail(tmp, 2)
    return tmp


def mean_by_step(log: Path, world: int) -> dict[int, float]:
    per_rank = [dict(ranks.losses(log, r)) for r in range(world)]
    return {s: sum(r[s] for r in per_rank) / world for s in per_rank[0]}


def test_two_ranks_train_and_the_loss_falls(baseline: Path) -> None:
    log = baseline / "events.jsonl"
    for rank in (0, 1):
        steps = ranks.losses(log, rank)
        assert [s for s, _ in steps] == list(range(STEPS))
        first = sum(loss for _, loss in steps[:3]) / 3
        last = sum(loss for _, loss in steps[-3:]) / 3
        assert last < 0.8 * first, (first, last)
    started = ranks.events(log, "RankStarted")
    assert sorted(e["rank"] for e in started) == [0, 1] and all(e["world_size"] == 2 for e in started)
    staged = ranks.events(log, "CheckpointStaged")
    assert sorted((e["step"], e["rank"]) for e in staged) == [(15, 0), (15, 1), (30, 0), (30, 1)]
    at15 = [e for e in staged if e["step"] == SAVE_AT]
    assert all(e["data"] == {"next_batch": SAVE_AT, "skipped": []} for e in at15)
    files = sorted(s["path"] for e in at15 for s in e["shards"])
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_restore_continues_bitwise(baseline: Path, tmp_path: Path) -> None:
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, train={"steps": STEPS, "checkpoint_every": 1000})
    ckpt = baseline / "staging" / "job-1" / f"step-{SAVE_AT}"
    codes = ranks.run(tmp_path, spec, world=2, job_id="job-2", args=("--restore", str(ckpt)))
    assert codes == [0, 0], ranks.log_tail(tmp_path, 2)
    for rank in (0, 1):
        expected = [(s, loss) for s, loss in ranks.losses(baseline / "events.jsonl", rank) if s >= SAVE_AT]
        assert ranks.losses(tmp_path / "events.jsonl", rank) == expected  # bitwise equal floats
    assert [e["from_step"] for e in ranks.events(tmp_path / "events.jsonl", "RankStarted")] == [SAVE_AT, SAVE_AT]


def test_reshard_two_ranks_to_one_continues_the_same_stream(baseline: Path, tmp_path: Path) -> None:
    spec = ranks.write_spec(tmp_path / "job.toml", slots=1, train={"steps": STEPS, "checkpoint_every": 1000})
    ckpt = baseline / "staging" / "job-1" / f"step-{SAVE_AT}"
    codes = ranks.run(tmp_path, spec, world=1, job_id="job-3", args=("--restore", str(ckpt)))
    assert codes == [0], ranks.log_tail(tmp_path, 1)
    # The one rank sees the whole global batch: its loss is the mean of the two ranks' slice losses.
    expected = {s: v for s, v in mean_by_step(baseline / "events.jsonl", 2).items() if s >= SAVE_AT}
    got = dict(ranks.losses(tmp_path / "events.jsonl", 0))
    assert sorted(got) == sorted(expected)
    worst = max(abs(got[s] - expected[s]) / expected[s] for s in expected)
    assert worst < RESHARD_RTOL, worst
    assert all(math.isfinite(v) for v in got.values())


def test_a_restore_whose_manifest_is_gone_is_refused_as_a_bad_checkpoint(baseline: Path, tmp_path: Path) -> None:
    """The node's copy can vanish between the agent's check and a rank's load: its agent deletes a checkpoint a
    peer refused. The rank refuses it as well (RESTORE_REFUSED_EXIT), not a crash (exit 1) that costs a restart."""
    spec = ranks.write_spec(tmp_path / "job.toml", slots=1)
    ckpt = baseline / "staging" / "job-1" / f"step-{SAVE_AT}"
    gone = tmp_path / "deleted" / "MANIFEST.json"
    codes = ranks.run(tmp_path, spec, world=1, job_id="job-4", args=("--restore", str(ckpt), "--manifest", str(gone)))
    assert codes == [RESTORE_REFUSED_EXIT], ranks.log_tail(tmp_path, 1)
    assert "restore refused: its checkpoint is bad; nothing was loaded" in ranks.log_tail(tmp_path, 1)


def test_plain_torchrun_starts_two_ranks(tmp_path: Path) -> None:
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, train={"steps": 6})
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone", "-m", "flightdeck.trainer",
           "--job-id", "tr-1", "--spec", str(spec), "--device", "cpu", "--staging", str(tmp_path / "staging"),
           "--events-log", str(tmp_path / "events.jsonl")]
    proc = subprocess.run(cmd, cwd=ranks.REPO, capture_output=True, text=True, timeout=ranks.RUN_TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert [s for s, _ in ranks.losses(tmp_path / "events.jsonl", rank)] == list(range(6))


def test_a_restore_skips_the_windows_of_rollbacks_decided_back_to_its_checkpoint(
        baseline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trial 7 (86ea31b): a rollback to this checkpoint skipping batches 15-18 was decided, and the restart that
    followed a crash trained them again. The agent hands the window over with the restore (lineage.restore_skips)."""
    monkeypatch.setenv(nl.RESTORE_SKIPS_ENV, "15:18")  # what the node agent sets (services/agent/spawner.py)
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, train={"steps": STEPS, "checkpoint_every": SAVE_AT})
    ckpt = baseline / "staging" / "job-1" / f"step-{SAVE_AT}"
    codes = ranks.run(tmp_path, spec, world=2, job_id="job-7", args=("--restore", str(ckpt)))
    assert codes == [0, 0], ranks.log_tail(tmp_path, 2)
    staged = [e for e in ranks.events(tmp_path / "events.jsonl", "CheckpointStaged") if e["step"] == STEPS]
    assert len(staged) == 2 and all(e["data"] == {"next_batch": STEPS + 3, "skipped": [[15, 18]]} for e in staged)
