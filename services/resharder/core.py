"""The resharder's pure core: a job's parallel plan for the slots it was granted, re-planned when they change.

Why it works this way: docs/internals.md, "4. Resources and the resharder".
"""

import math
from collections import Counter

import msgspec
from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.job import AllocationGranted, JobCancelled, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.services.core import Emit, Service
from flightdeck.services.resharder import gpus
from flightdeck.services.resharder.gpus import GpuType
from flightdeck.services.resharder.planner import PlanError, Slots, plan
from flightdeck.services.resharder.shapes import ModelShape, from_spec

NAME = "resharder"
CONTROL_TYPES = ("JobSubmitted", "AllocationGranted", "JobCompleted", "JobFailed", "JobCancelled")
FLEET_TYPES = ("NodeRegistered",)
UNKNOWN_SLOT_GB = 4.0  # a slot whose memory no registration told us (unregistered node, unread meminfo)


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    device: GpuType


class JobPlan(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelShape
    global_batch: int
    plan: ParallelPlan | None = None
    refused: str = ""  # why the latest grant got no plan, "" when it got one


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


def reason(old: ParallelPlan | None, new: ParallelPlan, grant: AllocationGranted, slots: Slots) -> str:
    nodes = len({ref.node for ref in grant.assignments})
    where = f"{new.world_size} {slots.gpu.name} slots on {nodes} node{'s' if nodes != 1 else ''}"
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
    try:
        new = plan(job.model, slots, job.global_batch).plan
    except PlanError as exc:
        return _with_job(state, grant.job_id, msgspec.structs.replace(job, refused=str(exc)))
    if new == job.plan:
        return _with_job(state, grant.job_id, msgspec.structs.replace(job, refused=""))
    event = ReshardPlanned(job_id=grant.job_id, old=job.plan, new=new, reason=reason(job.plan, new, grant, slots))
    return _with_job(state, grant.job_id, msgspec.structs.replace(job, plan=new, refused=""),
                     Emit(subjects.job(grant.job_id, "ReshardPlanned"), event))


def _with_job(state: State, job_id: str, job: JobPlan | None, *outputs: Emit) -> Transition:
    jobs = {k: v for k, v in state.jobs.items() if k != job_id}
    if job is not None:
        jobs[job_id] = job
    return msgspec.structs.replace(state, jobs=jobs), outputs


def transition(state: State, event: Event) -> Transition:
    match event:
        case JobSubmitted(job_id=job_id, spec=spec):
            return _with_job(state, job_id, JobPlan(model=from_spec(spec.model), global_batch=spec.train.batch_size))
        case AllocationGranted():
            return granted(state, event)
        case NodeRegistered(node=name):
            nodes = {**state.nodes, name: NodeInfo(device=device_of(event))}
            return msgspec.structs.replace(state, nodes=nodes), ()
        case JobCompleted(job_id=job_id) | JobFailed(job_id=job_id) | JobCancelled(job_id=job_id):
            return _with_job(state, job_id, None)
    return state, ()


def core_service() -> Service[State]:
    """The resharder core wired as a Service; it never needs a clock tick."""
    return Service(
        name=NAME,
        initial=State(),
        transition=transition,
        control_subjects=(*subjects.job_types(*CONTROL_TYPES),
                          *(f"fd.ctl.node.*.{t}" for t in FLEET_TYPES)),
        wants_tick=lambda state, now: False,
    )
