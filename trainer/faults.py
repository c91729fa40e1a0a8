"""Drill faults from JobSpec.faults: which fire on this rank in this attempt, and when.

    crash       exit with CRASH_EXIT_CODE at the step
    hang        stop stepping at the step (heartbeats go on) until SIGTERM
    loss_spike  global batches [step, step + SPIKE_BATCHES) are poisoned: every rank's reported loss for them is
                multiplied by flightdeck.trainer.reports.SPIKE_FACTOR; a rollback that skips that window removes it,
                which is the recovery being drilled
    nonfinite   the rank reports a NaN loss at the step
    slow        the rank sleeps `seconds` per step from the step on
    high_lr     from the step on, every rank's optimizer steps with its learning rate times `factor` (default 300):
                an optimisation problem, which comes back at the same step after a rollback
    corrupt     once, the rank's parameters get noise of `factor` (default 20) times each one's spread, as a faulty
                device's update would leave them: its replica leaves its peers', and a re-run does not repeat it
A fault pinned to an attempt (`attempt = N`) fires only in it. An unpinned one fires once, in the first attempt
that reaches its step: the node agent passes the indices of those an earlier attempt fired ($FLIGHTDECK_FIRED_FAULTS,
read from the job's FaultInjected events), and they stay quiet; without the platform (a torchrun restart) there is
no agent to ask, and an unpinned fault fires in the first run only. Within an attempt each fires at most once, except
`slow` (every step from its step on) and the spike's noisy data.
"""

import math
import time
from collections.abc import Callable

import torch

from flightdeck.events.spec import FaultSpec

CRASH_EXIT_CODE = 3
HANG_EXIT_CODE = 143  # a hung rank told to stop exits as if SIGTERM had killed it: it saved nothing
SPIKE_BATCHES = 3
HIGH_LR_FACTOR = 300.0
CORRUPT_SCALE = 20.0


def live(faults: list[FaultSpec], attempt: int, fired: frozenset[int]) -> list[tuple[int, FaultSpec]]:
    """The faults that may fire in `attempt`, with their indices in the spec: pinned to it, or unpinned and not
    fired by an earlier attempt."""
    return [(i, f) for i, f in enumerate(faults)
            if f.attempt == attempt or (f.attempt is None and i not in fired)]


class Faults:
    def __init__(self, faults: list[FaultSpec], rank: int, attempt: int, fired: frozenset[int] = frozenset()) -> None:
        armed = live(faults, attempt, fired)
        self.mine = [(i, f) for i, f in armed if f.rank == rank]
        # The spike is a property of the data, which every rank shares; only the named rank reports it.
        self.poison = [(f.step, f.step + SPIKE_BATCHES) for _, f in armed if f.kind == "loss_spike"]
        # So is a learning rate: every rank steps with it, or the replicas would part.
        self.boosts = [(f.step, f.factor or HIGH_LR_FACTOR) for _, f in armed if f.kind == "high_lr"]
        self.specs = dict(armed)
        self._fired: set[int] = set()

    def due(self, step: int, batch_index: int) -> list[tuple[int, FaultSpec]]:
        """Faults to announce and act on before running `step` (which reads `batch_index`), with their indices."""
        out = []
        for i, f in self.mine:
            at = batch_index if f.kind == "loss_spike" else step
            if i not in self._fired and f.step == at:
                self._fired.add(i)
                out.append((i, f))
        return out

    def poisoned(self, batch_index: int) -> bool:
        return any(a <= batch_index < b for a, b in self.poison)

    def lr_factor(self, step: int) -> float:
        return math.prod(factor for at, factor in self.boosts if at <= step)

    def spec(self, index: int) -> FaultSpec:
        return self.specs[index]

    def slow_seconds(self, step: int) -> float:
        return sum(f.seconds for _, f in self.mine if f.kind == "slow" and f.step <= step)


def scale_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    if factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor


def corrupt(model: torch.nn.Module | None, scale: float) -> None:
    """Noise of `scale` times each parameter's spread, from a generator of its own (the training's is untouched)."""
    if model is None:
        return
    gen = torch.Generator().manual_seed(0xC0FFEE)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
                p.add_(noise * (scale * p.float().std().item()))


def hang(stop: Callable[[], bool], poll_s: float = 0.2) -> None:
    """Block like a stuck collective would, until `stop()` says the rank was told to go."""
    while not stop():
        time.sleep(poll_s)
