"""The attempt a rank runs: --attempt when the node agent passes it, else torchrun's restart count (a plain
torchrun restart re-runs the same command line, so drill faults of attempt 0 must not fire again)."""

from pathlib import Path

from trainer.config import from_args

SPEC = 'name = "t"\n[train]\ndata = "synthetic"\n'


def attempt(tmp_path: Path, extra: list[str], env: dict[str, str]) -> int:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    return from_args(["--job-id", "t-1", "--spec", str(spec), "--device", "cpu", *extra], env=env).attempt


def test_the_flag_wins_then_torchruns_restart_count_then_zero(tmp_path: Path) -> None:
    assert attempt(tmp_path, ["--attempt", "2"], {"TORCHELASTIC_RESTART_COUNT": "5"}) == 2
    assert attempt(tmp_path, [], {"TORCHELASTIC_RESTART_COUNT": "1"}) == 1
    assert attempt(tmp_path, [], {}) == 0
