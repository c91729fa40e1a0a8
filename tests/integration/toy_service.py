"""Toy deciders the runtime tests run through the real shell (also as `python -m flightdeck.services toy`, registered
with FLIGHTDECK_EXTRA_SERVICES="toy=toy_service:build" and this folder on PYTHONPATH).

`toy` answers every JobSubmitted with a JobQueued (numbered by how many it has seen: outputs depend on
state) and, for every tenth job, a NodeHeartbeat; a CancelRequested with reason "boom" makes the core
raise, and with TOY_DIE=1 one with reason "die" kills the process (what a segfaulting core looks like);
every tick it emits a NodeHeartbeat on its clock node. `toytel` answers every StepCompleted it
folds with a CheckpointRequested naming the rank, the step and how many steps it had folded before.
`toyfx` also asks for an effect per job, recorded as a CheckpointRequested (jobs ending in "bad" fail it).
"""

import asyncio
import os
from dataclasses import dataclass, replace

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.commands import CheckpointRequested
from flightdeck.events.fleet import NodeHeartbeat
from flightdeck.events.job import CancelRequested, JobQueued, JobSubmitted
from flightdeck.events.training import StepCompleted
from flightdeck.services.core import Effect, Emit, Service

TICK_S = float(os.environ.get("TOY_TICK_S", "0.2"))
DIE = os.environ.get("TOY_DIE") == "1"


@dataclass(frozen=True)
class Tally:
    jobs: int = 0
    steps: int = 0
    ticks: int = 0


def evolve(state: Tally, ev: Event) -> Tally:
    match ev:
        case JobSubmitted():
            return replace(state, jobs=state.jobs + 1)
        case StepCompleted():
            return replace(state, steps=state.steps + 1)
        case ClockTick():
            return replace(state, ticks=state.ticks + 1)
        case CancelRequested(reason="boom"):
            raise RuntimeError(f"boom in {ev.job_id}")
        case CancelRequested(reason="die") if DIE:
            os._exit(17)
    return state


def decide(state: Tally, ev: Event) -> list[Emit]:
    match ev:
        case JobSubmitted():
            out = [Emit(subjects.job(ev.job_id, "JobQueued"), JobQueued(job_id=ev.job_id, priority=state.jobs))]
            if state.jobs % 10 == 0:
                out.append(Emit(subjects.node("toy-node", "NodeHeartbeat"),
                                NodeHeartbeat(node="toy-node", free_slots=state.jobs)))
            return out
        case StepCompleted():
            reason = f"{ev.rank}:{ev.step}:{state.steps - 1}"
            return [Emit(subjects.job(ev.job_id, "CheckpointRequested"),
                         CheckpointRequested(job_id=ev.job_id, reason=reason))]
        case ClockTick() if ev.service == "toy":
            return [Emit(subjects.node("toy-clock", "NodeHeartbeat"),
                         NodeHeartbeat(node="toy-clock", free_slots=state.jobs * 1000 + state.ticks))]
    return []


def transition(state: Tally, ev: Event) -> tuple[Tally, list[Emit | Effect]]:
    after = evolve(state, ev)
    return after, list(decide(after, ev))


def build() -> Service[Tally]:
    return Service(name="toy", initial=Tally(), transition=transition,
                   control_subjects=("fd.ctl.job.*.JobSubmitted", "fd.ctl.job.*.CancelRequested"),
                   tick_s=TICK_S, wants_tick=lambda state, now: state.jobs > 0)


def build_telemetry() -> Service[Tally]:
    return Service(name="toytel", initial=Tally(), transition=transition, control_subjects=(),
                   telemetry_subjects=("fd.tel.*.*.StepCompleted",), tick_s=0.1)


def build_prompted() -> Service[Tally]:
    """Ticks once a minute, but a StepCompleted brings the next tick forward."""
    return replace(build_telemetry(), name="toyprompt", tick_s=60.0,
                   prompt_types=frozenset({"StepCompleted"}))


def build_prompted_idle() -> Service[Tally]:
    """Prompted, and wanting no tick of its own (as the checkpoint service once a completed job's linger passed)."""
    return replace(build_prompted(), name="toyidle", wants_tick=lambda state, now: False)


async def _stamp(job_id: str) -> list[Emit]:
    """An effect: I/O the shell runs live (never in a replay) and whose outcome it records."""
    await asyncio.sleep(0.05)
    if job_id.endswith("bad"):
        raise RuntimeError(f"cannot stamp {job_id}")
    return [Emit(subjects.job(job_id, "CheckpointRequested"), CheckpointRequested(job_id=job_id, reason="stamped"))]


def _decide_effects(state: Tally, ev: Event) -> list[Emit | Effect]:
    if isinstance(ev, JobSubmitted):
        return [*decide(state, ev), Effect("stamp", ev.job_id)]
    return []


def _with_effects(state: Tally, ev: Event) -> tuple[Tally, list[Emit | Effect]]:
    after = evolve(state, ev)
    return after, _decide_effects(after, ev)


def build_effects() -> Service[Tally]:
    return Service(name="toyfx", initial=Tally(), transition=_with_effects,
                   control_subjects=("fd.ctl.job.*.JobSubmitted",), wants_tick=lambda state, now: False,
                   effects={"stamp": _stamp})
