"""On a GPU node the fork server's children get CUDA: nothing the server imports initialises the CUDA driver, so
the self-check forked from it passes on the node's GPU and a rank forked from it trains there. A child forked
after the driver was initialised could not (CUDA does not survive fork). Runs where nvidia-smi lists a GPU (the
device machine); skipped on the CPU boxes CI runs on."""

import importlib.util
import sys
from pathlib import Path

import pytest

from flightdeck.services.agent.forkserver import ForkServer, ForkServerGone
from flightdeck.services.agent.inventory import Inventory, _nvidia_gpus, selfcheck
from tests.integration.test_forkserver import forks, run, warm_server

__all__ = ["forks"]  # the fixture: a warm fork server, as the CPU tests use it

GPUS = _nvidia_gpus()
pytestmark = [pytest.mark.skipif(not GPUS, reason="nvidia-smi lists no GPU"), pytest.mark.timeout(240)]

RANK = """\
import sys, torch
assert 'torch._dynamo' in sys.modules  # forked warm, after the server's whole warm-up
print('initialised before', torch.cuda.is_initialized(), flush=True)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(5):
    loss = model(torch.randn(64, 256, device='cuda')).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print('trained on', torch.cuda.get_device_name(), 'loss', round(loss.item(), 4), flush=True)
"""


async def test_the_self_check_and_a_rank_forked_on_a_gpu_node_use_the_gpu(forks: ForkServer, tmp_path: Path) -> None:
    name, memory_gb = GPUS[0]
    verdict = await selfcheck(sys.executable, Inventory(kind="gpu", slots=1, devices=[name], memory_gb=memory_gb),
                              120, forks)
    assert verdict.ok, verdict
    assert forks.forked == 1
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    log = tmp_path / "rank.log"
    _, code = await run(forks, [sys.executable, str(script)], log)
    out = log.read_text()
    assert code == 0, out
    assert "initialised before False" in out and "trained on" in out, out
    assert forks.forked == 2


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
async def test_a_rank_forked_after_a_transformers_preload_still_trains_on_the_gpu(tmp_path: Path) -> None:
    async with warm_server(tmp_path, "transformers.models.gpt2.modeling_gpt2") as f:
        script = tmp_path / "rank.py"
        script.write_text("import sys\nassert 'transformers.models.gpt2.modeling_gpt2' in sys.modules\n" + RANK)
        _, code = await run(f, [sys.executable, str(script)], tmp_path / "rank.log")
        out = (tmp_path / "rank.log").read_text()
        assert code == 0 and "initialised before False" in out and "trained on" in out, out


async def test_a_preload_that_initialises_cuda_makes_the_server_refuse_every_fork(tmp_path: Path) -> None:
    async with warm_server(tmp_path, "tests.fixtures.cuda_init_probe") as f:
        with pytest.raises(ForkServerGone, match="an import initialised CUDA in the fork server"):
            await run(f, [sys.executable, "-c", "pass"], tmp_path / "rank.log")  # the agent starts it cold instead
        assert f.forked == 0
