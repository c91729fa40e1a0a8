"""Planner properties over random models and clusters, against a brute force written from the rules alone:
every returned plan obeys the layout rules, keeps the global batch, fits in memory, and is the first fit in
the documented search order; a refusal happens exactly when nothing fits; more GPUs never mean more days."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.plan import ParallelPlan
from flightdeck.services.resharder import gpus, memory, planner, shapes
from flightdeck.services.resharder.planner import PlanError, Slots

HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 96)
Case = tuple[shapes.ModelShape, Slots, int]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    heads = draw(st.sampled_from(HEADS))
    hidden = heads * draw(st.sampled_from((64, 128)))
    layers = draw(st.integers(1, 96))
    model = shapes.ModelShape(params=12 * layers * hidden * hidden * draw(st.sampled_from((1, 20, 200))),
                              layers=layers, heads=heads, hidden=hidden,
                              seq_len=draw(st.sampled_from((512, 2048))), vocab=50_257)
    per_node = draw(st.sampled_from((1, 2, 4, 6, 8)))
    world = draw(st.one_of(st.integers(1, 16).map(lambda n: n * per_node), st.integers(1, 200)))
    # Batches that allow pure DP, and batches smaller than the world that force TP or PP.
    batch = draw(st.one_of(st.integers(1, 4096), st.integers(1, 64).map(lambda k: k * world),
                           st.integers(1, 64).map(lambda k: max(1, k * world // 8))))
    return model, Slots(world, per_node, draw(st.sampled_from(gpus.KNOWN))), batch


Fit = tuple[tuple[int, ...], memory.MemoryEstimate]


def every_fit(model: shapes.ModelShape, slots: Slots, batch: int) -> list[Fit]:
    """Every (tp·pp, pp, zero, -micro_batch_size) that fits, straight from the rules; sorted, the first is the plan."""
    fits = []
    node = min(slots.gpus_per_node, slots.world)
    while slots.world % node or slots.gpus_per_node % node:  # ranks fill nodes in order: a TP group never straddles
        node -= 1
    for tp in range(1, node + 1):
        for pp in range(1, model.layers + 1):
            if model.heads % tp or node % tp or model.layers % pp or slots.world % (tp * pp):
                continue
            dp = slots.world // (tp * pp)
            if batch % dp:
                continue
            share = batch // dp
            for size in range(1, share + 1):
                if share % size:
                    continue
                micro = 1 if pp == 1 else share // size
                if pp > 1 and micro < 4 * pp:
                    continue
                for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                    need = memory.estimate(model, tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch_size=size,
                                           micro_batches=micro)
                    if need.total_gb <= memory.usable_gb(slots.gpu):
                        fits.append(((tp * pp, pp, zero, -size), need))
    return sorted(fits, key=lambda f: f[0])


@settings(max_examples=400, deadline=None)
@given(cases())
def test_a_plan_obeys_the_rules_and_is_the_first_fit_in_search_order(case: Case) -> None:
    model, slots, batch = case
    fits = every_fit(model, slots, batch)
    try:
        planned = planner.plan(model, slots, batch)
    except PlanError as exc:
        assert not fits, f"refused ({exc}) although {fits[0][0]} fits"
        assert str(exc)
        return
    p = planned.plan
    assert p.dp * p.tp * p.pp == p.world_size == slots.world
    assert model.heads % p.tp == 0 and slots.gpus_per_node % p.tp == 0 and p.tp <= slots.gpus_per_node
    assert model.layers % p.pp == 0
    assert p.pp == 1 or (p.micro_batches >= 4 * p.pp and p.grad_accum == 1 and planned.bubble <= 0.25)
    assert p.dp * p.micro_batch_size * p.micro_batches * p.grad_accum == batch
    assert planned.memory.total_gb <= memory.usable_gb(slots.gpu) and p.memory_per_gpu_gb <= slots.gpu.memory_gb
    assert fits and fits[0][0] == (p.tp * p.pp, p.pp, p.zero_stage, -p.micro_batch_size)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from((1e8, 7e9, 70e9, 175e9)), st.integers(3, 14), st.integers(0, 10), st.integers(1, 7))
def test_the_global_batch_is_kept_as_the_world_shrinks_and_grows(params: float, log_batch: int, log_nodes: int,
                                                                 lost: int) -> None:
    model, batch, nodes = shapes.derive(params), 2**log_batch, 2**log_nodes
    planned: dict[int, ParallelPlan] = {}
    for n in (nodes, max(1, nodes - lost), nodes // 2 or 1):  # a loss, a shrink to half
        try:
            planned[n] = planner.plan(model, Slots(8 * n, 8, gpus.lookup("h200")), batch).plan
        except PlanError:
            continue
        assert planned[n].world_size == 8 * n
    assert all(p.dp * p.micro_batch_size * p.micro_batches * p.grad_accum == batch for p in planned.values())
    if params <= 7e9 and batch >= 8 * nodes:  # pure DP (with ZeRO) fits these on power-of-two worlds
        assert nodes in planned and (nodes // 2 or 1) in planned
        assert planner.plan(model, Slots(8 * nodes, 8, gpus.lookup("h200")), batch).plan == planned[nodes]


@given(st.floats(1e6, 1e13), st.floats(1e9, 1e14), st.integers(1, 100_000), st.integers(1, 100_000),
       st.sampled_from(gpus.KNOWN), st.floats(0.05, 1.0))
def test_more_gpus_never_mean_more_days(params: float, tokens: float, a: int, b: int, gpu: gpus.GpuType,
                                        mfu: float) -> None:
    few, many = sorted((a, b))
    assert planner.training_days(params, tokens, many, gpu, mfu) <= planner.training_days(params, tokens, few, gpu, mfu)
