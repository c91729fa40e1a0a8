"""The planner on worked examples: GPT-3 175B on 8192 H100s, refusals with reasons, ZeRO and PP choices,
the memory model's byte counts, shapes derived from a parameter count, and the GPU table."""

import pytest

from flightdeck.services.resharder import gpus, memory, planner, shapes
from flightdeck.services.resharder.planner import PlanError, Slots

H100 = gpus.lookup("h100")


def gpt(layers: int, hidden: int, heads: int, **kw: int) -> shapes.ModelShape:
    return shapes.ModelShape(params=12 * layers * hidden * hidden, layers=layers, heads=heads, hidden=hidden, **kw)


def test_gpt3_175b_on_8192_h100s_at_half_mfu() -> None:
    model = shapes.derive(175e9)
    assert (model.layers, model.heads, model.hidden) == (96, 96, 12288)  # GPT-3's own shape
    batch = shapes.default_global_batch(model.seq_len)
    planned = planner.plan(model, Slots(8192, 8, H100), batch)
    p = planned.plan
    assert p.dp * p.tp * p.pp == p.world_size == 8192
    assert p.tp <= 8 and model.heads % p.tp == 0 and model.layers % p.pp == 0
    assert p.dp * p.micro_batch_size * p.micro_batches * p.grad_accum == batch == 2048
    # DP is capped by the batch (2048 sequences), so some model parallelism is forced, and with one
    # sequence per replica ZeRO-3 is what makes 175B fit at that TP.
    assert (p.dp, p.tp, p.pp, p.zero_stage) == (2048, 4, 1, 3)
    assert planned.memory.total_gb <= memory.usable_gb(H100)
    days = planner.training_days(175e9, 10e12, 8192, H100, 0.5)
    assert days == pytest.approx(6 * 175e9 * 10e12 / (8192 * 989e12 * 0.5) / 86400)
    assert 29 < days < 31


def test_a_model_too_big_for_its_gpus_says_how_much_it_needs_even_fully_sharded() -> None:
    with pytest.raises(PlanError) as err:
        planner.plan(shapes.derive(175e9), Slots(8, 8, H100), 2048)
    text = str(err.value)
    assert "175B-param model needs 350.8 GB per GPU" in text
    assert "TP=8" in text and "H100" in text and "80 GB" in text and "more GPUs" in text


def test_a_batch_no_layout_divides_is_refused_with_what_to_change() -> None:
    with pytest.raises(PlanError, match=r"global batch of 100 sequences.*multiple of 8192"):
        planner.plan(shapes.derive(175e9), Slots(8192, 8, H100), 100)


def test_a_tiny_model_is_pure_data_parallel_with_its_share_in_one_micro_batch() -> None:
    tiny = gpt(2, 64, 2, seq_len=64, vocab=256)
    for world, share in ((1, 8), (2, 4), (4, 2), (8, 1)):
        p = planner.plan(tiny, Slots(world, 2, gpus.slot("cpu", 4.0)), 8).plan
        assert (p.dp, p.tp, p.pp, p.zero_stage) == (world, 1, 1, 0)
        assert (p.micro_batch_size, p.micro_batches, p.grad_accum) == (share, 1, 1)


def test_the_lowest_zero_stage_that_fits_is_chosen() -> None:
    model = shapes.derive(7e9)
    p = planner.plan(model, Slots(64, 8, H100), 1024).plan
    assert (p.tp, p.pp, p.zero_stage) == (1, 1, 1)
    # ZeRO-0 keeps 16 bytes/param on every GPU: 112 GB, more than an H100 has.
    plain = memory.estimate(model, tp=1, pp=1, dp=64, zero_stage=0, micro_batch_size=1, micro_batches=1)
    assert plain.total_gb > memory.usable_gb(H100)


def test_when_the_batch_divides_only_with_pipeline_stages_micro_batches_keep_the_bubble_small() -> None:
    model = gpt(24, 2048, 16)
    planned = planner.plan(model, Slots(24, 8, H100), 64)  # DP of 24, 12, 6 or 3 does not divide 64
    p = planned.plan
    assert (p.dp, p.tp, p.pp) == (4, 2, 3)
    assert p.micro_batches >= 4 * p.pp and p.grad_accum == 1 and planned.bubble <= 0.25


def test_model_state_is_16_bytes_per_param_and_zero_shards_it_stage_by_stage() -> None:
    model = gpt(8, 1024, 8)
    p = model.params / 1e9

    def state(zero: int) -> tuple[float, float, float]:
        m = memory.estimate(model, tp=1, pp=1, dp=4, zero_stage=zero, micro_batch_size=1, micro_batches=1)
        return m.params_gb, m.grads_gb, m.optimizer_gb

    assert sum(state(0)) == pytest.approx(16 * p)
    assert state(1) == pytest.approx((2 * p, 2 * p, 12 * p / 4))
    assert state(2) == pytest.approx((2 * p, 2 * p / 4, 12 * p / 4))
    gathered = 2 * 2 * p / model.layers  # two whole layers' bf16 weights, gathered for compute
    assert state(3) == pytest.approx((2 * p / 4 + gathered, 2 * p / 4, 12 * p / 4))


def test_activations_follow_checkpointing_and_shrink_with_tp() -> None:
    model = gpt(8, 1024, 8, seq_len=1024, vocab=1000)
    one = memory.estimate(model, tp=1, pp=1, dp=1, zero_stage=0, micro_batch_size=1, micro_batches=1)
    sbh = 1024 * 1024
    assert one.activations_gb * 1e9 == pytest.approx(2 * sbh * 8 + 34 * sbh + 4 * 1024 * 1000)
    two = memory.estimate(model, tp=2, pp=1, dp=1, zero_stage=0, micro_batch_size=2, micro_batches=1)
    assert two.activations_gb == pytest.approx(one.activations_gb)  # twice the batch over twice the GPUs


@pytest.mark.parametrize("params, layers, heads, hidden", [
    (125e6, 8, 8, 1024), (7e9, 32, 32, 4096), (13e9, 40, 40, 5120), (175e9, 96, 96, 12288)])
def test_shapes_derived_from_params_are_gpt3_like(params: float, layers: int, heads: int, hidden: int) -> None:
    shape = shapes.derive(params)
    assert (shape.layers, shape.heads, shape.hidden) == (layers, heads, hidden)
    assert 12 * layers * hidden * hidden == pytest.approx(params, rel=0.25)


def test_given_numbers_are_kept_and_the_rest_fit_around_them() -> None:
    shape = shapes.derive(175e9, layers=80, heads=64)
    assert (shape.layers, shape.heads) == (80, 64) and shape.hidden % 64 == 0
    with pytest.raises(shapes.InvalidShape, match="multiple of heads"):
        shapes.derive(1e9, heads=3, hidden=1024)


def test_the_gpu_table_holds_the_datasheet_figures_and_names_what_it_knows() -> None:
    assert (gpus.lookup("A100-40GB").peak_tflops, gpus.lookup("a100-80gb").memory_gb) == (312.0, 80.0)
    assert (H100.memory_gb, H100.peak_tflops) == (80.0, 989.0)
    assert (gpus.lookup("h200").memory_gb, gpus.lookup("h200").peak_tflops) == (141.0, 989.0)
    assert gpus.match_device("NVIDIA H100 80GB HBM3") == H100
    assert gpus.match_device("NVIDIA A100-SXM4-80GB") == gpus.lookup("a100-80gb")
    assert gpus.match_device("Tesla T4") is None
    with pytest.raises(gpus.UnknownGpu, match=r"h100.*h200"):
        gpus.lookup("v100")


# Published setups, as their papers state them (issue 16).
BLOOM = shapes.ModelShape(params=176e9, layers=70, heads=112, hidden=14336, seq_len=2048, vocab=250880)
OPT = shapes.ModelShape(params=175e9, layers=96, heads=96, hidden=12288, seq_len=2048)
A100 = gpus.lookup("a100-80gb")


def test_bloom_s_own_layout_with_uneven_pipeline_stages_is_evaluated() -> None:
    """BLOOM-176B: 384 A100s as DP 8 x TP 4 x PP 12, ZeRO-1, 70 layers over 12 stages, micro-batch 2."""
    planned = planner.evaluate(BLOOM, Slots(384, 8, A100), 2048, dp=8, tp=4, pp=12, zero_stage=1,
                               micro_batch_size=2)
    p = planned.plan
    assert (p.dp, p.tp, p.pp, p.zero_stage, p.micro_batch_size, p.micro_batches, p.grad_accum) == \
           (8, 4, 12, 1, 2, 128, 1)
    heaviest = 176e9 * 6 / (70 * 4)  # the first stages hold 6 of the 70 layers, a quarter of each by TP
    assert planned.memory.params_gb == pytest.approx(2 * heaviest / 1e9)
    assert planned.memory.optimizer_gb == pytest.approx(12 * heaviest / 8 / 1e9)  # ZeRO-1 shards it over DP 8
    assert planned.memory.total_gb <= memory.usable_gb(A100)
    assert memory.stage_layers(70, 12) == 6
    assert planner.days_at(176e9, 366e9, 384, 150e12) == pytest.approx(6 * 176e9 * 366e9 / (384 * 150e12) / 86400)


def test_a_layout_that_cannot_hold_the_model_is_a_clear_error_not_an_assertion() -> None:
    with pytest.raises(memory.InvalidLayout, match="TP 3 does not divide the model's 112 attention heads"):
        memory.estimate(BLOOM, tp=3, pp=12, dp=8, zero_stage=1, micro_batch_size=2, micro_batches=128)
    with pytest.raises(memory.InvalidLayout, match="PP 80 stages for 70 layers"):
        memory.estimate(BLOOM, tp=4, pp=80, dp=1, zero_stage=0, micro_batch_size=1, micro_batches=1)
    with pytest.raises(memory.InvalidLayout, match="ZeRO stage 4"):
        memory.estimate(BLOOM, tp=4, pp=12, dp=8, zero_stage=4, micro_batch_size=1, micro_batches=1)
    slots = Slots(384, 8, A100)
    with pytest.raises(PlanError, match=r"DP 8 x TP 4 x PP 10 is 320 GPUs, but there are 384"):
        planner.evaluate(BLOOM, slots, 2048, dp=8, tp=4, pp=10)
    with pytest.raises(PlanError, match="2044 sequences does not split over DP 8"):
        planner.evaluate(BLOOM, slots, 2044, dp=8, tp=4, pp=12)
    with pytest.raises(PlanError, match="a micro-batch of 3 does not divide the 256 sequences"):
        planner.evaluate(BLOOM, slots, 2048, dp=8, tp=4, pp=12, micro_batch_size=3)
    with pytest.raises(PlanError, match="TP 3 does not divide"):
        planner.evaluate(BLOOM, Slots(288, 8, A100), 2048, dp=8, tp=3, pp=12)


def test_without_a_layout_for_the_batch_the_batches_that_split_are_named() -> None:
    """OPT-175B on 992 GPUs (31 x 32): no DP divides 2048 sequences; 2046 = 66 x 31 is the nearest that splits."""
    slots = Slots(992, 8, A100)
    assert planner.layouts(OPT, slots, 2048) == []
    assert planner.splitting_batches(OPT, slots, 2048) == [2046, 2077, 2108]
    assert all(planner.layouts(OPT, slots, b) for b in (2046, 2077, 2108))
