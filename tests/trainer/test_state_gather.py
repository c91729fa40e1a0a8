"""TrainState.live reuses get_state_dict's items while the same tensors hold the state: what it gives must be
what a fresh get_state_dict gives, step after step, and after anything that swaps the tensors."""

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict

from flightdeck.trainer.state import TrainState


def fresh(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, (opt,))
    flat, _ = flatten_state_dict({"model": model_sd, "optim": optim_sd})
    return flat


def same(live: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    want = fresh(model, opt)
    got = {k: v for k, v in live.items() if not k.startswith("rng.")}
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[key], torch.Tensor), key
            assert got[key].data_ptr() == value.data_ptr(), key  # the live memory, not a stale copy
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_reused_items_are_what_a_fresh_gather_gives_at_every_step(make: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = make(model.parameters())
    state = TrainState(model, opt, {}, rank=0, device=torch.device("cpu"))
    before = state.live()  # before the first step: the groups, no state (torch's made-up one is not the script's)
    assert not opt.state and not any(k.startswith("optim.state.") for k in before)
    for i in range(4):
        step(model, opt, lr=0.01 / (i + 1))  # the first step creates the optimizer's state tensors
        same(state.live(), model, opt)


def test_tensors_swapped_under_the_same_names_are_gathered_again() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, opt, {}, rank=0, device=torch.device("cpu"))
    step(model, opt, 0.01)
    state.live()
    model.weight.data = torch.ones(2, 8)  # new memory under the same Parameter
    same(state.live(), model, opt)
    opt.load_state_dict(opt.state_dict() | {})  # new state tensors
    saved = {k: v.clone() for k, v in opt.state[model.weight].items()}
    opt.state[model.weight] = saved
    same(state.live(), model, opt)
    assert state.live()["optim.state.weight.exp_avg"].data_ptr() == saved["exp_avg"].data_ptr()
