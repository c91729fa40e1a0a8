"""The built-in trainer runs the layout the plan records (trainer/layout.py): 4 ranks as TP 2 x PP 2, whose
checkpoint restores into other layouts and into DDP, each going on with the gradient norms the 4 ranks had: one
run, whatever its layout."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flightdeck.events import nodelocal as nl
from flightdeck.events.ranklink import LINK_ENV
from flightdeck.events.spec import check, parse_spec
from flightdeck.trainer.model import GPT, num_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def job(tmp: Path, tp: int, pp: int) -> Path:
    path = tmp / "job.toml"
    parallel = f"[parallel]\ntp = {tp}\npp = {pp}\n" if tp * pp > 1 else ""
    path.write_text(f'name = "layouts"\nslots = 4\n[model]\nn_layer = 4\nn_head = 4\nd_model = 32\nseq_len = 16\n'
                    f'[train]\nsteps = {STEPS}\nbatch_size = 16\ncheckpoint_every = 4\ndata = "synthetic"\n'
                    f'{parallel}[policy]\nmin_slots = 1\n')
    return path


def builtin(tmp: Path, tp: int, pp: int, ranks: int, restore: Path | None = None,
            runs: tuple[int, int] | None = None) -> dict[int, dict[str, Any]]:
    """Rank 0's steps by number, from a torchrun of `python -m flightdeck.trainer` asking for TP `tp` x PP `pp`
    and running as `runs` (the same when not given)."""
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (nl.JOB_ENV, LINK_ENV, nl.RESTORE_ENV)}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", nl.SPEC_ENV: str(job(tmp, tp, pp)),
                nl.EVENTS_LOG_ENV: str(tmp / "events.jsonl")})
    if restore is not None:
        env[nl.RESTORE_ENV] = str(restore)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
           "-m", "flightdeck.trainer"]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    run_tp, run_pp = runs or (tp, pp)
    if tp * pp > 1:  # the "parallel plan" log line
        assert f"'dp': {ranks // (run_tp * run_pp)}, 'tp': {run_tp}, 'pp': {run_pp}," in done.stdout
    else:  # DDP, which reads no plan
        assert "parallel plan" not in done.stdout
    rows = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines() if line.strip()]
    return {e["step"]: e for e in rows if e["type"] == "StepCompleted" and e["rank"] == 0}


def test_the_builtin_trainer_runs_tp_and_pp_and_reshards_its_checkpoint(tmp_path: Path) -> None:
    whole = builtin(tmp_path / "tp2-pp2", 2, 2, 4)
    assert sorted(whole) == list(range(STEPS))
    rows = [json.loads(line) for line in (tmp_path / "tp2-pp2" / "events.jsonl").read_text().splitlines() if line]
    (model,) = [e for e in rows if e["type"] == "ModelRegistered"]  # the whole GPT, though rank 0 holds a stage's share
    spec = check(parse_spec((tmp_path / "tp2-pp2" / "job.toml").read_bytes()))
    whole_gpt = num_params(GPT(spec.model))
    assert (model["params"], model["layers"], model["heads"], model["dp"]) == (whole_gpt, 4, 4, 1)
    ckpt = tmp_path / "tp2-pp2" / ".flightdeck" / "staging" / "local" / "step-4"
    # TP 2 x PP 1 (what 2 ranks hold of an asked TP 2 x PP 2: a lost node's layout), PP 2 x DP 2 (FSDP2), TP 2 x
    # DP 2 (FSDP2 over TP blocks, the norms replicated over the TP group), DDP
    for (tp, pp), (runs_tp, runs_pp), ranks in (((2, 2), (2, 1), 2), ((1, 2), (1, 2), 4), ((2, 1), (2, 1), 4),
                                                ((1, 1), (1, 1), 2)):
        resumed = builtin(tmp_path / f"tp{runs_tp}-pp{runs_pp}-on-{ranks}", tp, pp, ranks, restore=ckpt,
                          runs=(runs_tp, runs_pp))
        assert sorted(resumed) == list(range(4, STEPS)), (tp, pp, ranks)
        for step in range(4, STEPS):
            assert resumed[step]["grad_norm"] == pytest.approx(whole[step]["grad_norm"], rel=1e-5), (tp, pp, step)
