"""A script's own data loader (`run.batches(loader)`, trainer/loaders.py): after a crash and a resume from the
newest checkpoint, and after a restore with a rollback's skip window, each step reads exactly the samples an
uninterrupted run read for that global batch, over several epochs, for torchdata's StatefulDataLoader (restored
from its checkpointed state) and for a plain DataLoader shuffled with a seeded generator (read again up to the
restore point). Before, `register(loader=DataLoader(...))` raised, and the skip window worked only for data read
by `step.batch`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from flightdeck.events import nodelocal as nl
from flightdeck.trainer.loaders import Feed
from tests.trainer import ranks

STEPS, EVERY, CRASH_AT = 30, 5, 17
SCRIPT = """\
import json, os, sys

import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import flightdeck

kind, crash_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
data = torch.arange(40).float().unsqueeze(1)  # 10 batches an epoch: 30 steps are 3 epochs
make = StatefulDataLoader if kind == "stateful" else DataLoader
loader = make(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
run = flightdeck.init()
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run.register(model, opt)
with open(out, "a") as f:
    for step, batch in run.batches(loader):
        f.write(json.dumps([int(step), step.batch, batch.flatten().int().tolist()]) + "\\n")
        f.flush()
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.report(step, loss.detach())
        if int(step) == crash_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(3)
"""


def read(path: Path) -> list[tuple[int, int, list[int]]]:
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


def run_script(tmp: Path, kind: str, out: Path, *, crash_at: int = -1, restarts: int = 0,
               **env: str) -> subprocess.CompletedProcess[str]:
    spec = ranks.write_spec(tmp / "job.toml", train={"steps": STEPS, "checkpoint_every": EVERY})
    (tmp / "train.py").write_text(SCRIPT)
    full = {**os.environ, "PYTHONPATH": str(ranks.REPO), "OMP_NUM_THREADS": "1", nl.SPEC_ENV: str(spec),
            nl.STAGING_ENV: str(tmp / "staging"), nl.DEVICE_ENV: "cpu", "TORCHELASTIC_RESTART_COUNT": str(restarts),
            **env}
    return subprocess.run([sys.executable, "train.py", kind, str(crash_at), str(out)], cwd=tmp, env=full,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_loader_resumes_and_skips_on_the_same_samples_as_an_uninterrupted_run(tmp_path: Path, kind: str) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    done = run_script(whole, kind, whole / "seen.jsonl")
    assert done.returncode == 0, done.stderr[-3000:]
    baseline = read(whole / "seen.jsonl")
    assert [s for s, _, _ in baseline] == list(range(STEPS)) == [b for _, b, _ in baseline]
    assert sorted(x for _, _, xs in baseline[:10] for x in xs) == list(range(40))  # one epoch: every sample once
    assert baseline[:10] != baseline[10:20]  # the next epoch is shuffled anew
    by_batch = {b: xs for _, b, xs in baseline}

    # A crash after step 17, and the torchrun-style restart that resumes from the newest local checkpoint whose
    # write had finished (15, or 10 when the crash came before step 15's background write was done).
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    assert run_script(crashed, kind, crashed / "seen.jsonl", crash_at=CRASH_AT).returncode == 3
    again = run_script(crashed, kind, crashed / "seen.jsonl", restarts=1)
    assert again.returncode == 0, again.stderr[-3000:]
    seen = read(crashed / "seen.jsonl")
    resumed = seen[CRASH_AT + 1:]
    start = resumed[0][0]
    assert start in (10, 15) and [s for s, _, _ in resumed] == list(range(start, STEPS))
    assert all(xs == by_batch[b] for _, b, xs in seen), "a step read other samples than the uninterrupted run"

    # A restore of the step-15 checkpoint with a rollback's window [16, 19) to skip: step 16 reads batch 19.
    skipped = tmp_path / "skipped"
    skipped.mkdir()
    checkpoint = whole / "staging" / "local" / "step-15"  # the uninterrupted run's: written whole before it ended
    assert checkpoint.is_dir(), sorted(p.name for p in (whole / "staging").rglob("step-*"))
    restored = run_script(skipped, kind, skipped / "seen.jsonl",
                          **{nl.RESTORE_ENV: str(checkpoint), nl.RESTORE_SKIPS_ENV: "16:19"})
    assert restored.returncode == 0, restored.stderr[-3000:]
    rows = read(skipped / "seen.jsonl")
    assert [(s, b) for s, b, _ in rows[:3]] == [(15, 15), (16, 19), (17, 20)]
    assert rows[-1][:2] == (STEPS - 1, STEPS + 2)
    assert all(xs == by_batch.get(b, xs) for _, b, xs in rows)  # the batches the baseline also read: equal
    assert [xs for _, b, xs in rows if b < STEPS] == [by_batch[b] for _, b, _ in rows if b < STEPS]


def test_a_snapshot_before_the_first_batch_leaves_the_loaders_draws_to_the_first_step() -> None:
    """Asked for its state before its first batch, torchdata's StatefulDataLoader made its iterator then, drawing its
    seed from the script's RNG at the step-0 snapshot rather than at the first step: a job on the platform drew other
    dropout masks than the script alone (issue 52, tests/e2e/test_differential.py)."""
    def first(snapshot_first: bool) -> tuple[list[int], float]:
        data = torch.arange(40).float()
        torch.manual_seed(11)  # the script's seeding; its shuffle draws its seed from the RNG (no generator given)
        feed = Feed(StatefulDataLoader(data, batch_size=4, shuffle=True), seed=11)
        torch.manual_seed(3)  # whatever the script's stream holds at the step-0 snapshot
        if snapshot_first:
            assert feed.state_dict()["loader"] is None  # nothing read yet: a restore starts it afresh
        torch.manual_seed(5)  # the step's seed (trainer/seeding.py), set after the boundary's snapshot
        batch = feed.take(0)
        return batch.int().tolist(), torch.rand(()).item()  # the batch, and what the step's dropout would draw

    assert first(snapshot_first=True) == first(snapshot_first=False)
