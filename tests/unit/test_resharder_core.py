"""The resharder core: ReshardPlanned on a first grant, a shrink and a grow back, nothing on an identical
re-grant; the device from the nodes' registrations; a deterministic replay; the core beside the scheduler and
resources cores, where a restart onto a node of the same kind changes no plan; and the script's own model
(ModelRegistered) planned in place of the spec's [model] defaults."""

import asyncio

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.fleet import NodeLost, NodeRegistered
from flightdeck.events.job import AllocationGranted, JobCompleted, JobSubmitted, SlotRef
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import EntrypointSpec, JobSpec, ModelSpec, TrainSpec
from flightdeck.events.store import MemoryStore
from flightdeck.events.training import ModelRegistered
from flightdeck.services.resharder.core import REPORT_WAIT_S, UNKNOWN_SLOT_GB, core_service, wants_tick
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.shell.fold import comparable, outputs_of, replay
from tests.unit.helpers import Agents, Bus, append, events_of, fold, register, submit

SERVICE = core_service()


def job(job_id: str = "job-1", *, slots: int = 2, batch: int = 8, **model: int) -> JobSubmitted:
    return JobSubmitted(job_id=job_id, spec=JobSpec(name=job_id.split("-")[0], slots=slots,
                                                    model=ModelSpec(**model), train=TrainSpec(batch_size=batch)))


def script(job_id: str = "job-1", *, slots: int = 2) -> JobSubmitted:
    """A user's script: its spec's [model] is the defaults, not its model."""
    return JobSubmitted(job_id=job_id, spec=JobSpec(name="script", slots=slots,
                                                    entrypoint=EntrypointSpec(command=["python", "train.py"])))


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


def model(params: int = 500_000_000, *, job_id: str = "job-1", micro_batch: int = 2, grad_accum: int = 4,
          world_size: int = 2, **shape: int) -> ModelRegistered:
    fields = {"layers": 24, "heads": 16, "hidden": 1024, "vocab": 50_257, "seq_len": 1024, **shape}
    return ModelRegistered(job_id=job_id, rank=0, params=params, trainable=params, param_bytes=4 * params,
                           micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size, source="config",
                           **fields)


def test_the_script_s_model_replans_once_with_its_size_and_its_batch() -> None:
    """A user's script runs with the spec's [model] defaults (a tiny GPT) until it registers its own: 1.5B
    parameters do not fit plain data parallelism in 8 GB slots (16 bytes each with Adam), so the plan shards them
    (ZeRO); its batch is its
    own (2 a forward x 4 accumulated x 2 ranks = 16), not the spec's 8."""
    history = [cpu("n0", slots=2, memory_gb=16.0), script(), grant({"n0": 2})]
    state, outs = fold(SERVICE, [*history, model(), model(params=7)])  # a second report changes nothing
    first, registered = events_of(outs, ReshardPlanned)
    assert (first.new.zero_stage, first.new.memory_per_gpu_gb < 0.1) == (0, True)
    assert registered.old == first.new and registered.new.world_size == 2
    assert registered.new.micro_batch_size * registered.new.grad_accum * registered.new.dp == 16
    assert registered.new.zero_stage > 0 and registered.new.memory_per_gpu_gb > 1.0  # sized for 500M, not the defaults
    assert registered.reason.startswith("the model the script registered: 500M parameters (from its config: 24 "
                                        "layers, 16 heads, hidden 1024, sequence 1024), 16 sequences a step (2 a "
                                        "forward x 4 accumulated x 2 replicas)")
    job_plan = state.jobs["job-1"]
    assert job_plan.reported and job_plan.plan == registered.new and job_plan.global_batch == 16


def test_a_report_before_the_grant_sizes_its_first_plan_and_a_later_grant_keeps_it() -> None:
    _, outs = fold(SERVICE, [cpu("n0", slots=2, memory_gb=64.0), script(), model(micro_batch=4, grad_accum=1),
                                 grant({"n0": 2}), grant({"n0": 1}, attempt=1)])
    first, shrink = events_of(outs, ReshardPlanned)
    assert first.reason.startswith("first grant") and first.new.memory_per_gpu_gb > 1.0
    assert shrink.reason.startswith("shrink: world 2 -> 1") and shrink.new.micro_batch_size * shrink.new.grad_accum == 8


def test_a_model_with_nothing_but_parameters_is_planned_without_a_vocabulary_or_sequence() -> None:
    _, outs = fold(SERVICE, [cpu("n0"), script(), grant({"n0": 2}),
                             model(params=81, layers=0, heads=0, hidden=0, vocab=0, seq_len=0, micro_batch=0)])
    (_, registered) = events_of(outs, ReshardPlanned)
    assert "81 parameters" in registered.reason and "sequence 1)" in registered.reason
    assert "the spec's 8 sequences a step" in registered.reason  # no batch seen: the spec's stands


def test_a_model_that_cannot_be_laid_out_is_refused_with_the_reason_and_the_plan_kept() -> None:
    state, outs = fold(SERVICE, [cpu("n0"), script(), grant({"n0": 2}), model(params=0)])
    (first,) = events_of(outs, ReshardPlanned)
    assert state.jobs["job-1"].plan == first.new and state.jobs["job-1"].reported
    assert state.jobs["job-1"].refused.startswith("the model the script registered cannot be planned: params")


def test_it_ticks_to_fold_a_report_only_after_a_grant_until_one_came_or_the_wait_ran_out() -> None:
    submitted, _ = fold(SERVICE, [cpu("n0"), script()])
    assert not wants_tick(submitted, 1_000.0)  # nothing granted: no plan to change
    at = 1_700_000_000.0
    granted, _ = fold(SERVICE, [cpu("n0"), script(), msgspec.structs.replace(grant({"n0": 2}), occurred_at=at)])
    assert wants_tick(granted, at + 1) and not wants_tick(granted, at + REPORT_WAIT_S)
    reported, _ = fold(SERVICE, [model()], granted)
    assert not wants_tick(reported, at + 1)


def test_the_built_in_trainer_s_report_changes_nothing_its_spec_is_its_model() -> None:
    state, outs = fold(SERVICE, [cpu("n0"), job(), grant({"n0": 2}), model()])
    assert len(events_of(outs, ReshardPlanned)) == 1 and not wants_tick(state, 0.0)
