"""The resharder's pure core: a job's parallel plan for the slots it was granted, re-planned when they change, and
once more when the job's script reports the model it registered (a script's spec holds no [model] of its own).

Why it works this way: docs/internals.md, "4. Resources and the resharder".
"""

import math
from collections import Counter
from collections.abc import Callable

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.job import AllocationGranted, JobCancelled, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.training import ModelRegistered
from flightdeck.services.core import Emit, Service
from flightdeck.services.resharder import gpus
from flightdeck.services.resharder.gpus import GpuType
from flightdeck.services.resharder.planner import PlanError, Slots, count, plan
from flightdeck.services.resharder.shapes import InvalidShape, ModelShape, from_spec, reported

NAME = "resharder"
CONTROL_TYPES = ("JobSubmitted", "AllocationGranted", "JobCompleted", "JobFailed", "JobCancelled")
FLEET_TYPES = ("NodeRegistered",)
TELEMETRY_TYPES = ("ModelRegistered",)
# Telemetry is folded at ticks: tick this long after a grant while its script's model is unreported (a report
# arriving later is folded at the next grant's ticks).
REPORT_WAIT_S = 300.0
UNKNOWN_SLOT_GB = 4.0  # a slot whose memory no registration told us (unregistered node, unread meminfo)


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    device: GpuType


class JobPlan(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelShape
    global_batch: int
    plan: ParallelPlan | None = None
    refused: str = ""  # why the latest grant got no plan, "" when it got one
    slots: Slots | None = None  # the latest grant's, planned again when the script reports its model
    granted_at: float = 0.0
    asked: tuple[int, int] = (1, 1)  # the spec's [parallel] TP x PP
    # `model` and `global_batch` are the script's (ModelRegistered), or need no report: the built-in trainer's
    # model is the spec's [model] itself
    reported: bool = False


class State(msgspec.Struct, frozen=True, kw_only=True):
    jobs: dict[str, JobPlan] = {}
    nodes: dict[str, NodeInfo] = {}


def device_of(registered: NodeRegistered) -> GpuType:
    """A GPU node registers each device's memory; a CPU node its host memory, which its slots share."""
    if registered.kind == "gpu" and registered.devices:
        known = gpus.match_device(registered.devices[0])
        return known or gpus.slot(registered.devices[0], registered.memory_gb or UNKNOWN_SLOT_GB)
    share = registered.memory_gb / max(1, registered.slots)
    return gpus.slot(registered.kind, share or UNKNOWN_SLOT_GB)


def slots_of(state: State, grant: AllocationGranted) -> Slots:
    """The granted world; TP groups must fit every node's share, and the smallest device bounds memory."""
    per_node = Counter(ref.node for ref in grant.assignments)
    devices = [state.nodes[n].device if n in state.nodes else gpus.slot("unregistered", UNKNOWN_SLOT_GB)
               for n in sorted(per_node)]
    return Slots(world=len(grant.assignments), gpus_per_node=math.gcd(*per_node.values()),
                 gpu=min(devices, key=lambda d: d.memory_gb))


def reason(old: ParallelPlan | None, new: ParallelPlan, grant: AllocationGranted, slots: Slots,
           asked: tuple[int, int] = (1, 1)) -> str:
    nodes = len({ref.node for ref in grant.assignments})
    where = f"{new.world_size} {slots.gpu.name} slots on {nodes} node{'s' if nodes != 1 else ''}"
    if asked != (1, 1):
        held = f"TP {new.tp} x PP {new.pp} x DP {new.dp}"
        where += (f", {held} as asked" if (new.tp, new.pp) == asked else
                  f", {held}: the nearest to the asked TP {asked[0]} x PP {asked[1]} these slots hold")
    if old is None:
        return f"first grant: {where} (attempt {grant.attempt})"
    if new.world_size == old.world_size:
        return f"same world size, new layout: {where} (attempt {grant.attempt})"
    change = "shrink" if new.world_size < old.world_size else "grow"
    return f"{change}: world {old.world_size} -> {new.world_size}, {where} (attempt {grant.attempt})"


Transition = tuple[State, tuple[Emit, ...]]


def granted(state: State, grant: AllocationGranted) -> Transition:
    job = state.jobs.get(grant.job_id)
    if job is None or not grant.assignments:
        return state, ()
    slots = slots_of(state, grant)
    job = msgspec.structs.replace(job, slots=slots, granted_at=grant.occurred_at)
    return _replanned(state, grant.job_id, job, lambda new: reason(job.plan, new, grant, slots, job.asked))


def _replanned(state: State, job_id: str, job: JobPlan, why: Callable[[ParallelPlan], str]) -> Transition:
    """`job` planned for its latest slots; a ReshardPlanned when the plan changes."""
    if job.slots is None:
        return _with_job(state, job_id, job)
    try:
        new = plan(job.model, job.slots, job.global_batch, job.asked).plan
    except PlanError as exc:
        return _with_job(state, job_id, msgspec.structs.replace(job, refused=str(exc)))
    if new == job.plan:
        return _with_job(state, job_id, msgspec.structs.replace(job, refused=""))
    event = ReshardPlanned(job_id=job_id, old=job.plan, new=new, reason=why(new))
    return _with_job(state, job_id, msgspec.structs.replace(job, plan=new, refused=""),
                     Emit(subjects.job(job_id, "ReshardPlanned"), event))


def registered(state: State, ev: ModelRegistered) -> Transition:
    """A script's own model and batch replace the spec's [model] defaults, once per job (the built-in trainer's
    report says what its spec did)."""
    job = state.jobs.get(ev.job_id)
    if job is None or job.reported:
        return state, ()
    try:
        model = reported(ev)
    except InvalidShape as exc:
        return _with_job(state, ev.job_id, msgspec.structs.replace(
            job, reported=True, refused=f"the model the script registered cannot be planned: {exc}"))
    accum = max(1, ev.grad_accum)
    replicas = ev.dp or ev.world_size  # every rank of a TP group or a pipeline reads its replica's batch
    batch = ev.micro_batch * accum * replicas if ev.micro_batch > 0 else job.global_batch
    fed = (f"{batch} sequences a step ({ev.micro_batch} a forward x {accum} accumulated x {replicas} replicas)"
           if ev.micro_batch > 0 else f"the spec's {batch} sequences a step")
    said = f"from its {ev.source}: " if ev.source else ""
    why = (f"the model the script registered: {count(model.params)} parameters ({said}{model.layers} layers, "
           f"{model.heads} heads, hidden {model.hidden}, sequence {model.seq_len}), {fed}; planned before from the "
           f"spec's [model] ({count(job.model.params)}); ranks that read run.plan from now on, and later attempts, "
           "get this one")
    return _replanned(state, ev.job_id, msgspec.structs.replace(job, model=model, global_batch=batch, reported=True),
                      lambda new: why)


def _with_job(state: State, job_id: str, job: JobPlan | None, *outputs: Emit) -> Transition:
    jobs = {k: v for k, v in state.jobs.items() if k != job_id}
    if job is not None:
        jobs[job_id] = job
    return msgspec.structs.replace(state, jobs=jobs), outputs


def transition(state: State, event: Event) -> Transition:
    match event:
        case JobSubmitted(job_id=job_id, spec=spec):
            return _with_job(state, job_id, JobPlan(model=from_spec(spec.model), global_batch=spec.train.batch_size,
                                                    reported=spec.entrypoint is None,
                                                    asked=(spec.parallel.tp, spec.parallel.pp)))
        case AllocationGranted():
            return granted(state, event)
        case NodeRegistered(node=name):
            nodes = {**state.nodes, name: NodeInfo(device=device_of(event))}
            return msgspec.structs.replace(state, nodes=nodes), ()
        case ModelRegistered():
            return registered(state, event)
        case JobCompleted(job_id=job_id) | JobFailed(job_id=job_id) | JobCancelled(job_id=job_id):
            return _with_job(state, job_id, None)
        case ClockTick():  # it only brings the telemetry folded before it
            return state, ()
    return state, ()


def wants_tick(state: State, now: float) -> bool:
    """Tick (to fold the scripts' ModelRegistered) while a granted job's model is unreported, for a while."""
    return any(not job.reported and job.slots is not None and now - job.granted_at < REPORT_WAIT_S
               for job in state.jobs.values())


def core_service() -> Service[State]:
    """The resharder core wired as a Service; it ticks only to fold the scripts' model reports."""
    return Service(
        name=NAME,
        initial=State(),
        transition=transition,
        control_subjects=(*subjects.job_types(*CONTROL_TYPES),
                          *(f"fd.ctl.node.*.{t}" for t in FLEET_TYPES)),
        telemetry_subjects=tuple(f"fd.tel.*.*.{t}" for t in TELEMETRY_TYPES),
        prompt_types=frozenset(TELEMETRY_TYPES),
        wants_tick=wants_tick,
    )
