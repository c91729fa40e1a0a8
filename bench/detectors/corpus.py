"""The detector corpus: loss curves, each labelled with the spikes it truly has.

Fault-free curves come from two places: real runs of every shipped example and of the built-in trainer
(recorded by bench/detectors/record.py into curves/*.json), and seeded synthetic curves with the shapes healthy
training shows and a naive detector mistakes for spikes (heavy-tailed noise, slow drift, a learning-rate
schedule's restart, a plateau and a sudden drop, warm-up). Injected spikes multiply a fault-free curve's losses
at labelled steps, in the shapes real spikes take: one step x10, short bursts, a sustained divergence of x1.5-x3
over tens of steps, a climb that ends in NaN.
"""

import functools
import itertools
import json
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CURVES = Path(__file__).resolve().parent / "curves"


@dataclass(frozen=True)
class Curve:
    name: str
    loss: tuple[float, ...]
    lr: tuple[float, ...]  # 0: not reported
    step_time_s: float  # the median, for delays in seconds
    kind: str  # "recorded" or "synthetic"

    @functools.cached_property  # read once per trial: 33 trials a curve
    def noise(self) -> float:
        """The loss's own step-to-step noise past step 300, as a robust standard deviation of log(loss): a spike of
        x2 stands log(2) / noise of these above it."""
        logs = [math.log(x) for x in self.loss[300:] if x > 0]
        diffs = [b - a for a, b in itertools.pairwise(logs)]
        mid = statistics.median(diffs)
        return 1.4826 * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2)


@dataclass(frozen=True)
class Shape:
    """An injected spike: `factors[i]` multiplies the loss of step onset + i (NaN: the loss becomes NaN)."""

    name: str
    factors: tuple[float, ...]
    must_find: bool  # the goal: x2 or more that lasts 3 steps or more (a lone step that heals needs no rollback)

    @property
    def length(self) -> int:
        return len(self.factors)


def ramp(lo: float, hi: float, up: int, hold: int) -> tuple[float, ...]:
    return tuple(lo + (hi - lo) * (i + 1) / up for i in range(up)) + (hi,) * hold


SHAPES = (
    Shape("one step x10", (10.0,), must_find=False),
    Shape("two steps x4", (4.0, 4.0), must_find=False),
    Shape("three steps x2", (2.0,) * 3, must_find=True),
    Shape("burst of 5 at x3", (3.0,) * 5, must_find=True),
    Shape("divergence to x1.5 over 40", ramp(1.0, 1.5, 10, 30), must_find=False),
    Shape("divergence to x2 over 30", ramp(1.0, 2.0, 10, 20), must_find=True),
    Shape("divergence to x3 over 20", ramp(1.0, 3.0, 5, 15), must_find=True),
    Shape("climb to NaN", (*ramp(1.0, 4.0, 8, 0), math.nan), must_find=True),
)


@dataclass(frozen=True)
class Trial:
    curve: Curve
    shape: Shape | None  # None: the curve as it is (fault-free)
    onset: int = -1
    loss: tuple[float, ...] = field(default=(), repr=False)


def recorded() -> list[Curve]:
    out = []
    for path in sorted(CURVES.glob("*.json")):
        raw = json.loads(path.read_text())
        times = sorted(raw["step_time_s"]["0"])
        out.append(Curve(raw["name"], tuple(raw["loss"]), tuple(raw["lr"]), times[len(times) // 2], "recorded"))
    return out


def _decay(step: int, top: float, floor: float, tau: float) -> float:
    return floor + (top - floor) * math.exp(-step / tau)


def _noise(rng: random.Random, kind: str, sigma: float) -> float:
    """A multiplicative noise factor: Gaussian, or heavy-tailed (Student t with 3 degrees of freedom, in log)."""
    if kind == "gauss":
        return 1.0 + sigma * rng.gauss(0.0, 1.0)
    t = rng.gauss(0.0, 1.0) / math.sqrt(sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(3)) / 3)
    return math.exp(sigma * t)


def _cosine(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


Synth = Callable[[random.Random, int], tuple[list[float], list[float]]]


def _plain(noise: str, sigma: float) -> Synth:
    def make(rng: random.Random, steps: int) -> tuple[list[float], list[float]]:
        tau = rng.uniform(150, 800)
        lrs = [_cosine(s, steps, 3e-3, 100) for s in range(steps)]
        return [_decay(s, 4.0, 1.5, tau) * _noise(rng, noise, sigma) for s in range(steps)], lrs
    return make


def _drift(rng: random.Random, steps: int) -> tuple[list[float], list[float]]:
    """Falls, then creeps up by a fifth over the run (overfitting, a data mix shifting): no spike."""
    tau = rng.uniform(150, 400)
    return [(_decay(s, 3.0, 1.0, tau) + 0.2 * s / steps) * _noise(rng, "gauss", 0.02) for s in range(steps)], \
        [1e-3] * steps


def _restarts(rng: random.Random, steps: int) -> tuple[list[float], list[float]]:
    """SGDR: the LR restarts every `period` steps and the loss rises for a while after each restart."""
    period = rng.choice((500, 750, 1000))
    lrs = [1e-3 * 0.5 * (1 + math.cos(math.pi * (s % period) / period)) for s in range(steps)]
    loss = []
    for s in range(steps):
        since = s % period
        bump = 0.0 if s < period else 0.35 * math.exp(-since / 60) * (1 - math.exp(-since / 8))
        loss.append((_decay(s, 3.0, 1.2, 300) + bump) * _noise(rng, "gauss", 0.02))
    return loss, lrs


def _plateau_drop(rng: random.Random, steps: int) -> tuple[list[float], list[float]]:
    """A step decay: a plateau, then a sudden drop when the LR falls tenfold (twice)."""
    cuts = sorted(rng.sample(range(steps // 4, steps - 200), 2))
    lrs, loss = [], []
    for s in range(steps):
        n = sum(s >= c for c in cuts)
        lrs.append(1e-2 * 0.1 ** n)
        loss.append((_decay(s, 3.0, 1.6, 200) * 0.7 ** n) * _noise(rng, "gauss", 0.03))
    return loss, lrs


def _classifier(rng: random.Random, steps: int) -> tuple[list[float], list[float]]:
    """Small-batch classification: a loss near zero whose per-batch values are heavy-tailed (hard examples)."""
    return [_decay(s, 1.4, 0.08, 300) * _noise(rng, "t3", 0.45) for s in range(steps)], [0.0] * steps


SYNTHETIC: dict[str, Synth] = {
    "gauss 1%": _plain("gauss", 0.01),
    "gauss 5%": _plain("gauss", 0.05),
    "heavy-tailed 10%": _plain("t3", 0.10),
    "heavy-tailed 25%": _plain("t3", 0.25),
    "slow drift": _drift,
    "LR restarts": _restarts,
    "plateau and drops": _plateau_drop,
    "heavy-tailed classifier": _classifier,
}


def synthetic(seeds: int, steps: int = 3000) -> list[Curve]:
    out = []
    for name, make in SYNTHETIC.items():
        for seed in range(seeds):
            rng = random.Random(f"{name}/{seed}")
            loss, lrs = make(rng, steps)
            out.append(Curve(f"{name} #{seed}", tuple(loss), tuple(lrs), 0.1, "synthetic"))
    return out


def inject(curve: Curve, shape: Shape, onset: int) -> tuple[float, ...]:
    loss = list(curve.loss)
    for i, f in enumerate(shape.factors):
        loss[onset + i] = math.nan if math.isnan(f) else loss[onset + i] * f
    return tuple(loss)


def trials(curves: list[Curve], *, positions: int, first: int = 300, seed: int = 0) -> list[Trial]:
    """Every curve fault-free, and each shape injected at `positions` seeded steps past `first` (one per trial)."""
    rng = random.Random(seed)
    out = [Trial(c, None, loss=c.loss) for c in curves]
    for c in curves:
        for shape in SHAPES:
            for _ in range(positions):
                onset = rng.randrange(first, len(c.loss) - shape.length - 50)
                out.append(Trial(c, shape, onset, inject(c, shape, onset)))
    return out
