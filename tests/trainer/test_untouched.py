"""Nothing Flightdeck does to save or restore a rank's state changes the script's training (trainer/untouched.py).

torch's get_state_dict steps an optimizer that has no state yet on zero gradients to make it some: a snapshot at
step 0 left AdamW's `step` at 1 before the script's first step, so a job on the platform trained differently from
the same script alone (issue 52, finding 1). Each test runs a script's loop twice, once as it is and once with
Flightdeck's reads and loads at its boundaries, and holds the two bitwise equal."""

from pathlib import Path
from typing import Any

import pytest
import torch

from flightdeck.events.checkpoint import DataPosition
from flightdeck.trainer import checkpointing, distributed
from flightdeck.trainer.checkpointing import Checkpointer
from flightdeck.trainer.state import TrainState
from flightdeck.trainer.untouched import fresh

CPU = torch.device("cpu")


class Script:
    """A user's loop: AdamW with weight decay, a warm-up scheduler stepped per optimizer step, dropout, and a hook
    of its own that counts the optimizer's steps (an EMA would do the same)."""

    def __init__(self, *, fused: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.hooked = 0
        self.opt.register_step_post_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.hooked += 1

    def step(self, i: int) -> float:
        g = torch.Generator().manual_seed(i)
        torch.manual_seed(1000 + i)  # the dropout's: the two scripts of a test take turns on one process's RNG
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        loss = (self.model(x) - y).square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss.item()

    def digest(self) -> list[torch.Tensor]:
        out = [p.detach().clone() for p in self.model.parameters()]
        for per in self.opt.state.values():
            out += [v.clone() for v in per.values()]
        return out


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_reading_the_state_before_the_first_step_leaves_the_optimizer_fresh(fused: bool) -> None:
    alone, watched = Script(fused=fused), Script(fused=fused)
    state = TrainState(watched.model, watched.opt, {}, rank=0, device=CPU)
    live = state.live()  # what a step-0 snapshot or checkpoint reads
    assert fresh(watched.opt) and not watched.opt.state
    assert not any(k.startswith("optim.state.") for k in live)
    assert live["optim.param_groups.0.lr"] == pytest.approx(2.5e-3)  # the scheduler's first factor, as set
    assert watched.hooked == 0 and "_opt_called" not in watched.opt.__dict__
    losses = []
    for i in range(6):
        state.live()
        losses.append((alone.step(i), watched.step(i)))
    assert [a for a, _ in losses] == [b for _, b in losses]
    assert equal(alone.digest(), watched.digest()) and alone.hooked == watched.hooked == 6
    assert [float(per["step"]) for per in watched.opt.state.values()] == [6.0] * 4


def save(tmp: Path, state: TrainState, step: int) -> Path:
    ckpt = Checkpointer(job_id="j", staging=tmp, dist=distributed.init(0, 1, 0, "cpu"), emit=lambda _: None,
                        envelope={"job_id": "j", "rank": 0, "attempt": 0, "node": "n"})
    ckpt.save(step, state.live(), DataPosition(next_batch=step))
    ckpt.wait()
    return ckpt.staged_dir(step, 0)


def load(path: Path, script: Script) -> TrainState:
    state = TrainState(script.model, script.opt, {"sched": script.sched}, rank=0, device=CPU)
    checkpointing.load(path, state, distributed.init(0, 1, 0, "cpu"))
    return state


def test_a_checkpoint_of_step_0_restores_a_fresh_optimizer_into_a_new_process_and_a_rollback(tmp_path: Path) -> None:
    alone, first = Script(), Script()
    path = save(tmp_path, TrainState(first.model, first.opt, {"sched": first.sched}, rank=0, device=CPU), 0)
    restarted = Script()  # a new attempt: the script builds its objects again, then restores step 0
    for p in restarted.model.parameters():
        p.data.add_(1.0)  # not the saved weights: the restore must put them back
    load(path, restarted)
    assert fresh(restarted.opt) and restarted.hooked == 0
    got: list[Any] = []
    for i in range(5):
        got.append((alone.step(i), restarted.step(i), first.step(i)))
    assert all(a == b == c for a, b, c in got)
    assert equal(alone.digest(), restarted.digest())
    # a rollback to that checkpoint in the live process: the optimizer's state goes, as it was at step 0
    torch.manual_seed(0)
    load(path, first)
    assert not first.opt.state and first.opt.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    again = Script()
    assert [first.step(i) for i in range(3)] == [again.step(i) for i in range(3)]
    assert equal(first.digest(), again.digest())


def test_a_restore_into_a_fresh_optimizer_runs_none_of_the_scripts_hooks(tmp_path: Path) -> None:
    trained = Script()
    for i in range(3):
        trained.step(i)
    path = save(tmp_path, TrainState(trained.model, trained.opt, {"sched": trained.sched}, rank=0, device=CPU), 3)
    restarted = Script()
    load(path, restarted)
    assert restarted.hooked == 0 and "_opt_called" not in restarted.opt.__dict__
    assert equal(trained.digest(), restarted.digest())
    assert [trained.step(i) for i in range(3, 6)] == [restarted.step(i) for i in range(3, 6)]
