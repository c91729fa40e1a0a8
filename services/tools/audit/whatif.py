"""`flightdeck whatif`: the job's decisions under changed settings, and a first-order estimate of the goodput.

The simulation (simulate.py) gives the decisions that vanish, appear or differ. Each recovery that vanishes
saves what the recorded one cost (measured.py); one that appears costs what a recorded one of its kind did; a
failure that appears ends the job there, keeping only the work up to its newest checkpoint. Nothing is modelled
beyond that: the telemetry after a changed decision is the live run's, so everything after the first change is
counterfactual.
"""

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss
from flightdeck.events.job import AllocationRequested, JobCompleted, JobFailed
from flightdeck.events.store import Stored
from flightdeck.services.tools.audit import settings as setting
from flightdeck.services.tools.audit.cores import cores, settings_notes, unrecorded_settings
from flightdeck.services.tools.audit.measured import Measured, measure
from flightdeck.services.tools.audit.simulate import Change, Outcome, simulate, submitted_spec

CAVEATS = (
    "Decisions up to the first change are exact: every input before it happened as recorded.",
    "After it the replay still feeds the telemetry the live run produced, which a changed decision would have "
    "changed (losses after a rollback not taken, steps after a restart not made did not happen): later changes "
    "are counterfactual.",
    "The goodput estimate is first-order: it adds or removes the measured cost of each recovery and nothing else.",
    "Other jobs and the fleet are taken as recorded.",
)


@dataclass(frozen=True, slots=True)
class Estimate:
    what: str
    seconds: float  # wall time added (+) or saved (-)
    note: str = ""


@dataclass(frozen=True, slots=True)
class WhatIf:
    job_id: str
    settings: dict[str, tuple[Any, Any]]  # key -> (recorded, what-if)
    outcome: Outcome
    measured: Measured
    estimates: list[Estimate]
    wall_s: float
    useful_s: float
    ends: str  # how the job ends in the what-if
    caveats: tuple[str, ...]

    @property
    def changes(self) -> list[Change]:
        return self.outcome.changes

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0


def whatif(rows: list[Stored], job_id: str, changes: Mapping[str, Any]) -> WhatIf:
    """Replay `job_id`'s history (`rows`) with `changes` ({"policy.spike_z": 8, ...}) applied to its spec."""
    spec = submitted_spec(rows, job_id)
    new = setting.apply(spec, changes)
    outcome = simulate(job_id, rows, new)
    m = measure(rows, job_id)
    diff = setting.changed(spec, new)
    failed = next((c for c in outcome.changes if c.kind == "appears" and isinstance(c.simulated, JobFailed)), None)
    # past a failure the job is over: what else changes after it costs or saves nothing
    estimates = [e for c in outcome.changes if (failed is None or c.position < failed.position)
                 and (e := _estimate(c, m, outcome)) is not None]
    control = [s for s in rows if s.stream == subjects.CONTROL]
    # the settings the simulation used (an old history's, where it recorded none), not today's defaults
    caveats: tuple[str, ...] = (*CAVEATS, *settings_notes(unrecorded_settings(cores(), control), control))
    if "train.checkpoint_every" in diff:
        estimates += _interval(m, *diff["train.checkpoint_every"])
        caveats = (*caveats, "train.checkpoint_every is the trainer's: the recorded checkpoints stay in the replay; "
                   "its effect is estimated from the recorded incidents as if every checkpoint committed at once.")
    if failed is not None and isinstance(failed.simulated, JobFailed):
        at = failed.simulated.occurred_at
        kept = max((step for t, step in m.commits if t <= at), default=0)
        wall, useful = at - m.start, kept * m.step_s
        ends = f"failed at +{wall:.1f}s ({failed.simulated.reason}); work kept: up to the checkpoint at step {kept}"
        estimates.append(Estimate(f"job fails at +{wall:.1f}s instead of ending {m.outcome} at +{m.wall_s:.1f}s",
                                  wall - m.wall_s, f"useful work drops to {kept} of {m.steps} steps"))
        return WhatIf(job_id, diff, outcome, m, estimates, wall, useful, ends, caveats)
    completes = not any(c.kind == "vanishes" and isinstance(c.event, JobCompleted) for c in outcome.changes)
    wall = m.wall_s + sum(e.seconds for e in estimates)
    ends = m.outcome if completes else "not completed within the recorded history"
    return WhatIf(job_id, diff, outcome, m, estimates, wall, m.useful_s if completes else 0.0, ends, caveats)


def _estimate(c: Change, m: Measured, outcome: Outcome) -> Estimate | None:
    ev = c.event
    recorded = {i.decision_id: i for i in m.incidents}
    if c.kind == "vanishes" and ev.event_id in recorded:
        inc = recorded[ev.event_id]
        what = f"{inc.kind} to step {inc.restore_step} avoided"
        note = f"saves {inc.fault_step + 1 - inc.restore_step} redone steps and the stop/restore measured live"
        if isinstance(ev, RollbackRequested):
            note += _spike_left(ev.trigger_id, outcome)
        return Estimate(what, -inc.lost_s, note)
    if c.kind == "appears" and isinstance(ev, RollbackRequested):
        step = _finding_step(ev.trigger_id, outcome) or ev.skip_from
        overhead = _overhead(m, "rollback")
        redo = max(step - ev.to_step, 0)
        return Estimate(f"new rollback to step {ev.to_step} (finding at step {step})",
                        redo * m.step_s + (overhead or 0.0),
                        f"{redo} redone steps" + (f" + {overhead:.1f}s stop/restore as measured live" if overhead
                                                  is not None else "; no recorded rollback to measure a restore by"))
    if c.kind == "appears" and isinstance(ev, AllocationRequested) and ev.attempt > 0:
        overhead = _median([i.lost_s for i in m.incidents if i.kind == "restart"])
        if overhead is None:
            return Estimate(f"new restart (attempt {ev.attempt})", 0.0, "cost unknown: no recorded restart to measure")
        return Estimate(f"new restart (attempt {ev.attempt})", overhead, "a restart costs what the recorded ones did")
    old = c.recorded.event if c.recorded is not None else None
    if c.kind == "differs" and isinstance(ev, RollbackRequested) and isinstance(old, RollbackRequested):
        delta = old.to_step - ev.to_step
        if delta:
            return Estimate(f"rollback to step {ev.to_step} instead of {old.to_step}", delta * m.step_s,
                            f"{delta:+d} redone steps")
    return None


def _interval(m: Measured, old: int, new: int) -> list[Estimate]:
    """A different checkpoint interval: more or fewer stalls, and each recovery restores from elsewhere."""
    out = [Estimate(f"checkpoints every {new} steps instead of {old}",
                    (m.steps // new - m.steps // old) * m.stall_s,
                    f"{m.steps // new} checkpoints at the {m.stall_s * 1000:.1f} ms stall measured per checkpoint")]
    for inc in m.incidents:
        # a restart restores the newest commit before the fault; a rollback the newest one at least steps_back
        # before the spike, which the recorded rollback's own target stands for
        bound = inc.fault_step if inc.kind == "restart" else inc.restore_step
        then, now = (bound // old) * old, (bound // new) * new
        if then != now:
            out.append(Estimate(f"the {inc.kind} at step {inc.fault_step} restores step {now} instead of {then}",
                                (then - now) * m.step_s, f"{then - now:+d} redone steps"))
    return out


def _overhead(m: Measured, kind: str) -> float | None:
    """What a recorded recovery of `kind` cost beyond its redone steps (detect, stop, restore)."""
    return _median([max(i.lost_s - (i.fault_step + 1 - i.restore_step) * m.step_s, 0.0)
                    for i in m.incidents if i.kind == kind and i.regained])


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _finding_step(trigger_id: str, outcome: Outcome) -> int | None:
    for s in outcome.timeline:
        if s.event is not None and s.event.event_id == trigger_id and isinstance(s.event, LossSpikeDetected
                                                                                  | NonFiniteLoss):
            return s.event.step
    return None


def _spike_left(trigger_id: str, outcome: Outcome) -> str:
    spike = next((c.event for c in outcome.changes if c.kind == "vanishes" and c.event.event_id == trigger_id), None)
    if isinstance(spike, LossSpikeDetected):
        return (f"; but the loss spike at step {spike.step} ({spike.loss:.3f} against a median of "
                f"{spike.baseline:.3f}, z {spike.z:.1f}) stays in the run and its batches are trained on: "
                "whether training recovers by itself is unknown")
    return "; what the fault it answered would have done instead is unknown"
