"""The resharder core: ReshardPlanned on a first grant, a shrink and a grow back, nothing on an identical
re-grant; the device from the nodes' registrations; a deterministic replay; and the core beside the
scheduler and resources cores, where a restart onto a node of the same kind changes no plan."""

import asyncio

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.fleet import NodeLost, NodeRegistered
from flightdeck.events.job import AllocationGranted, JobCompleted, JobSubmitted, SlotRef
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.events.store import MemoryStore
from flightdeck.services.resharder.core import UNKNOWN_SLOT_GB, core_service
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.shell.fold import comparable, outputs_of, replay

from tests.unit.helpers import Agents, Bus, append, events_of, fold, register, submit

SERVICE = core_service()


def job(job_id: str = "job-1", *, slots: int = 2, batch: int = 8, **model: int) -> JobSubmitted:
    return JobSubmitted(job_id=job_id, spec=JobSpec(name=job_id.split("-")[0], slots=slots,
                                                    model=ModelSpec(**model), train=TrainSpec(batch_size=batch)))


def grant(per_node: dict[str, int], *, attempt: int = 0, job_id: str = "job-1") -> AllocationGranted:
    refs, rank = [], 0
    for node, count in per_node.items():
        for slot in range(count):
            refs.append(SlotRef(node=node, slot=slot, rank=rank))
            rank += 1
    return AllocationGranted(job_id=job_id, attempt=attempt, assignments=refs)


def cpu(node: str, slots: int = 2, memory_gb: float = 16.0) -> NodeRegistered:
    return NodeRegistered(node=node, kind="cpu", slots=slots, devices=["cpu"] * slots, memory_gb=memory_gb)


HISTORY: list[Event] = [cpu("n0"), cpu("n1"), job(), grant({"n0": 1, "n1": 1}),  # first grant: 2 ranks
                        grant({"n0": 1}, attempt=1),  # n1 lost: 2 -> 1
                        grant({"n0": 1}, attempt=2),  # the same again: nothing changes
                        grant({"n0": 1, "n1": 1}, attempt=3)]  # n1 back: 1 -> 2


def test_first_grant_shrink_and_grow_each_plan_once_and_an_identical_regrant_plans_nothing() -> None:
    state, outs = fold(SERVICE, HISTORY)
    assert [o.subject for o in outs] == [subjects.job("job-1", "ReshardPlanned")] * 3
    first, shrink, grow = events_of(outs, ReshardPlanned)
    assert first.old is None and first.reason.startswith("first grant: 2 cpu slots on 2 nodes")
    assert (first.new.world_size, first.new.dp, first.new.tp, first.new.pp) == (2, 2, 1, 1)
    assert (first.new.micro_batch_size, first.new.grad_accum) == (4, 1)  # 8 sequences over 2 ranks
    assert shrink.old == first.new and shrink.reason.startswith("shrink: world 2 -> 1")
    assert (shrink.new.world_size, shrink.new.dp, shrink.new.micro_batch_size * shrink.new.grad_accum) == (1, 1, 8)
    assert grow.old == shrink.new and grow.new == first.new and grow.reason.startswith("grow: world 1 -> 2")
    assert state.jobs["job-1"].plan == first.new


def test_tiny_cpu_models_are_pure_data_parallel_at_every_world_size() -> None:
    for world in (1, 2, 4, 8):
        _, outs = fold(SERVICE, [cpu("n0", slots=8), job(slots=world), grant({"n0": world})])
        (planned,) = events_of(outs, ReshardPlanned)
        assert (planned.new.dp, planned.new.tp, planned.new.pp, planned.new.zero_stage) == (world, 1, 1, 0)


def test_a_grant_no_layout_fits_plans_nothing_and_says_why() -> None:
    state, outs = fold(SERVICE, [cpu("n0", slots=3), job(slots=3), grant({"n0": 3})])  # 8 sequences over 3
    assert outs == [] and state.jobs["job-1"].plan is None
    assert "global batch of 8 sequences" in state.jobs["job-1"].refused
    state, outs = fold(SERVICE, [grant({"n0": 2}, attempt=1)], state)
    assert len(outs) == 1 and state.jobs["job-1"].refused == ""


def test_the_device_comes_from_the_registrations_and_the_smallest_bounds_the_plan() -> None:
    h100 = NodeRegistered(node="g0", kind="gpu", slots=8, devices=["NVIDIA H100 80GB HBM3"] * 8, memory_gb=79.6)
    _, outs = fold(SERVICE, [h100, job(slots=8), grant({"g0": 8})])
    assert "H100 SXM 80GB slots" in events_of(outs, ReshardPlanned)[0].reason
    # 1 GB of host memory shared by 8 CPU slots cannot hold a model that an H100 holds easily.
    big = {"n_layer": 8, "d_model": 1024, "n_head": 8}
    _, outs = fold(SERVICE, [h100, cpu("c0", slots=8, memory_gb=1.0), job(slots=8, **big), grant({"g0": 8})])
    assert len(events_of(outs, ReshardPlanned)) == 1
    state, outs = fold(SERVICE, [h100, cpu("c0", slots=8, memory_gb=1.0), job(slots=8, **big),
                                 grant({"g0": 4, "c0": 4})])
    assert outs == [] and "GB per GPU" in state.jobs["job-1"].refused
    # A node granted before its registration was read counts as a small slot, not as nothing.
    _, outs = fold(SERVICE, [job(slots=1), grant({"unknown": 1})])
    assert "unregistered slots" in events_of(outs, ReshardPlanned)[0].reason and UNKNOWN_SLOT_GB > 0


def test_a_finished_job_is_forgotten() -> None:
    state, _ = fold(SERVICE, [*HISTORY[:4], JobCompleted(job_id="job-1", steps=100)])
    assert state.jobs == {}
    _, outs = fold(SERVICE, [grant({"n0": 1}, attempt=9)], state)
    assert outs == []


def test_folding_the_same_history_twice_gives_the_same_state_and_outputs() -> None:
    assert fold(SERVICE, HISTORY) == fold(SERVICE, HISTORY)


def test_a_replay_over_the_store_decides_what_the_fold_decided() -> None:
    async def replayed() -> list[dict[str, object]]:
        store = MemoryStore()
        for n, ev in enumerate(HISTORY):
            subject = (subjects.node(ev.node, type(ev).__name__) if isinstance(ev, NodeRegistered)
                       else subjects.job("job-1", type(ev).__name__))
            await append(store, subject, ev, msg_id=f"ext:{n}")
        steps = [step async for step in replay(SERVICE, store)]
        assert not any(step.error for step in steps)
        return [comparable(out.event) for out in outputs_of(steps)]

    first, second = asyncio.run(replayed()), asyncio.run(replayed())
    assert first == second and len(first) == 3
    _, outs = fold(SERVICE, HISTORY)
    assert [e["new"] for e in first] == [comparable(o.event)["new"] for o in outs]


def test_beside_the_scheduler_a_restart_onto_a_node_of_the_same_kind_changes_no_plan() -> None:
    bus = Bus([scheduler(memory_wait=False), resources(), SERVICE])
    bus.publish(register("n0", 2), register("n1", 2))
    agents = Agents(bus)
    bus.publish(submit("a-1", slots=2))
    agents()
    (planned,) = bus.of(ReshardPlanned, "a-1")
    assert planned.new.world_size == 2 and planned.causation_id == bus.last_grant("a-1").event_id
    bus.publish(NodeLost(node=bus.last_grant("a-1").assignments[0].node, reason="psu"))
    agents()
    assert bus.last_grant("a-1").attempt == 1  # restarted on the other node with the same two slots
    assert len(bus.of(ReshardPlanned, "a-1")) == 1
