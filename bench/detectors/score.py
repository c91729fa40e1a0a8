"""Scoring a spike detector on the corpus: false findings on fault-free curves, recall and delay per injected shape,
precision over everything. A finding in [onset, onset + length + GRACE) of an injected spike is true; any other
finding is false."""

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from bench.detectors.corpus import SHAPES, Trial
from flightdeck.events.spec import PolicySpec

GRACE = 10  # steps after an injected spike ends in which a finding still names it
QUIET = 0.10  # curves whose per-step noise (corpus.Curve.noise) is at most this: x2 stands 7 noise sigmas out
# ("quiet" recall also leaves out onsets in the wait after an LR rise: score.after_lr_rise)


class Detector(Protocol):
    def observe(self, step: int, loss: float, lr: float) -> int | None:
        """The step a finding names (its evidence's newest), or None."""


@dataclass
class ShapeScore:
    trials: int = 0
    found: int = 0
    delays: list[int] = field(default_factory=list)  # finding step - onset
    delays_s: list[float] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)  # "curve @ onset"
    quiet_trials: int = 0  # on curves with noise <= QUIET, and not in the wait after an LR rise
    quiet_found: int = 0
    blind: int = 0  # onsets within a window after an LR rise, where the rule waits for a new baseline

    @property
    def recall(self) -> float:
        return self.found / self.trials if self.trials else 1.0


@dataclass
class Score:
    detector: str
    clean_curves: int = 0
    clean_steps: int = 0
    clean_false: int = 0
    clean_false_curves: list[str] = field(default_factory=list)
    injected_false: int = 0  # findings on injected curves away from the spike
    true: int = 0
    shapes: dict[str, ShapeScore] = field(default_factory=dict)

    @property
    def precision(self) -> float:
        found = self.true + self.clean_false + self.injected_false
        return self.true / found if found else 1.0

    def goal_recall(self, *, quiet: bool = False) -> float:
        """Recall over the shapes the goal names; `quiet`: on curves with noise <= QUIET only."""
        wanted = [self.shapes[s.name] for s in SHAPES if s.must_find and s.name in self.shapes]
        trials = sum(s.quiet_trials if quiet else s.trials for s in wanted)
        return sum(s.quiet_found if quiet else s.found for s in wanted) / trials if trials else 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "detector": self.detector, "precision": round(self.precision, 4),
            "goal_recall": round(self.goal_recall(), 4),
            "goal_recall_quiet_curves": round(self.goal_recall(quiet=True), 4),
            "fault_free": {"curves": self.clean_curves, "steps": self.clean_steps, "false_findings": self.clean_false,
                           "curves_with_false_findings": sorted(set(self.clean_false_curves))},
            "false_findings_beside_injected_spikes": self.injected_false,
            "shapes": {name: {"trials": s.trials, "found": s.found, "recall": round(s.recall, 4),
                              "median_delay_steps": statistics.median(s.delays) if s.delays else None,
                              "max_delay_steps": max(s.delays) if s.delays else None,
                              "median_delay_s": round(statistics.median(s.delays_s), 3) if s.delays_s else None,
                              "quiet_trials": s.quiet_trials, "quiet_found": s.quiet_found,
                              "after_lr_rise": s.blind, "missed": s.missed[:8]}
                       for name, s in self.shapes.items()},
        }


def after_lr_rise(lr: tuple[float, ...], onset: int, window: int) -> bool:
    """Whether `onset` falls within `window` steps after the LR rose (SpikeWatch waits for a full new baseline)."""
    return any(lr[i] > lr[i - 1] * 1.01 for i in range(max(1, onset - window - 1), onset + 1))


def findings(detector: Detector, loss: tuple[float, ...], lr: tuple[float, ...]) -> list[int]:
    return [found for step, (x, rate) in enumerate(zip(loss, lr, strict=True))
            if (found := detector.observe(step, x, rate)) is not None]


def score(name: str, make: Callable[[], Detector], trials: list[Trial]) -> Score:
    out = Score(name)
    for t in trials:
        steps = findings(make(), t.loss, t.curve.lr)
        if t.shape is None:
            out.clean_curves += 1
            out.clean_steps += len(t.loss)
            out.clean_false += len(steps)
            out.clean_false_curves += [t.curve.name] * len(steps)
            continue
        s = out.shapes.setdefault(t.shape.name, ShapeScore())
        s.trials += 1
        blind = after_lr_rise(t.curve.lr, t.onset, PolicySpec().spike_window)
        quiet = t.curve.noise <= QUIET and not blind
        s.blind += blind
        s.quiet_trials += quiet
        end = t.onset + t.shape.length + GRACE
        hits = [x for x in steps if t.onset <= x < end]
        out.injected_false += len(steps) - len(hits)
        if hits:
            s.found += 1
            s.quiet_found += quiet
            out.true += 1
            s.delays.append(hits[0] - t.onset)
            s.delays_s.append((hits[0] - t.onset) * t.curve.step_time_s)
        else:
            s.missed.append(f"{t.curve.name} @ {t.onset}")
    return out
