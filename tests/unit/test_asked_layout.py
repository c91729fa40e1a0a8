"""A job that asks for TP x PP ([parallel]) gets that layout when its ranks hold it, and the nearest smaller one
when they do not (a shrink after a lost node), with the reason saying which; the same rule lays out a script run
without a plan (no resharder, no platform). The spec refuses a layout its slots cannot hold whole."""

from pathlib import Path

import pytest

from flightdeck.events.job import JobSubmitted
from flightdeck.events.plan import MESH_DIMS, ParallelPlan, ReshardPlanned, coordinates, nearest_layouts, unplanned
from flightdeck.events.spec import EntrypointSpec, InvalidSpec, JobSpec, ParallelSpec, TrainSpec, check
from flightdeck.events.training import ModelRegistered
from tests.unit.helpers import events_of, fold
from tests.unit.test_resharder_core import SERVICE, cpu, grant


def asking(tp: int, pp: int, *, slots: int = 4, batch: int = 8) -> JobSubmitted:
    spec = JobSpec(name="tppp", slots=slots, train=TrainSpec(batch_size=batch), parallel=ParallelSpec(tp=tp, pp=pp),
                   entrypoint=EntrypointSpec(command=["python", "train.py"]))
    return JobSubmitted(job_id="job-1", spec=check(spec))


def layout(plan: ParallelPlan) -> tuple[int, int, int, int]:
    return plan.world_size, plan.dp, plan.tp, plan.pp


def test_nearest_layouts_keep_tp_before_pp_and_end_with_data_parallelism() -> None:
    assert nearest_layouts(4, 2, 2) == [(2, 2), (2, 1), (1, 2), (1, 1)]
    assert nearest_layouts(2, 2, 2) == [(2, 1), (1, 2), (1, 1)]
    assert nearest_layouts(6, 4, 2) == [(2, 1), (1, 2), (1, 1)]  # TP 4 and TP 2 x PP 2 do not divide 6
    assert nearest_layouts(3, 2, 2) == [(1, 1)]


def test_coordinates_follow_the_mesh_order_the_example_builds() -> None:
    example = (Path(__file__).resolve().parents[2] / "examples" / "tp_pp" / "train.py").read_text()
    assert "mesh_dim_names=(" + ", ".join(f'"{d}"' for d in MESH_DIMS) + ")" in example
    plan = ParallelPlan(world_size=8, dp=2, tp=2, pp=2)
    assert [tuple(coordinates(plan, r).values()) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_a_run_without_a_plan_takes_the_asked_layout_its_world_holds() -> None:
    assert layout(unplanned(4, 2, 2)) == (4, 1, 2, 2) and unplanned(4, 2, 2).micro_batches == 2
    assert layout(unplanned(8, 2, 2)) == (8, 2, 2, 2)
    assert layout(unplanned(2, 2, 2)) == (2, 1, 2, 1)
    assert layout(unplanned(3)) == (3, 3, 1, 1)


def test_the_asked_layout_is_planned_and_a_shrink_keeps_tp_and_says_so() -> None:
    history = [cpu("n0"), cpu("n1"), asking(2, 2), grant({"n0": 2, "n1": 2}), grant({"n0": 2}, attempt=1)]
    _, outs = fold(SERVICE, history)
    first, shrink = events_of(outs, ReshardPlanned)
    assert layout(first.new) == (4, 1, 2, 2)
    assert first.new.micro_batches * first.new.micro_batch_size == 8  # the replica's whole batch, in micro-batches
    assert "TP 2 x PP 2 x DP 1 as asked" in first.reason
    assert layout(shrink.new) == (2, 1, 2, 1)
    assert shrink.reason.startswith("shrink: world 4 -> 2") and \
        "TP 2 x PP 1 x DP 1: the nearest to the asked TP 2 x PP 2 these slots hold" in shrink.reason


def test_a_script_s_report_from_one_pipeline_stage_counts_its_replicas_not_its_ranks() -> None:
    # rank 0 of a TP 2 x PP 2 layout runs 8 micro-batches of 1 a step; the 4 ranks are one replica of 8 sequences
    report = ModelRegistered(job_id="job-1", rank=0, params=30_000, trainable=30_000, param_bytes=120_000,
                             layers=4, heads=4, hidden=32, vocab=64, seq_len=16, micro_batch=1, grad_accum=8,
                             world_size=4, dp=1, source="config")
    history = [cpu("n0"), cpu("n1"), asking(2, 2), grant({"n0": 2, "n1": 2}), report]
    state, _ = fold(SERVICE, history)
    assert state.jobs["job-1"].global_batch == 8
    assert layout(state.jobs["job-1"].plan) == (4, 1, 2, 2)


@pytest.mark.parametrize(("tp", "pp", "slots", "words"), [
    (2, 2, 6, "parallel.tp x parallel.pp (2 x 2 = 4) must divide slots (6)"),
    (3, 1, 4, "parallel.tp x parallel.pp (3 x 1 = 3) must divide slots (4)"),
])
def test_a_layout_the_slots_cannot_hold_whole_is_refused(tp: int, pp: int, slots: int, words: str) -> None:
    with pytest.raises(InvalidSpec, match=words.replace("(", r"\(").replace(")", r"\)")):
        asking(tp, pp, slots=slots)


@pytest.mark.parametrize(("tp", "pp", "words"), [
    (4, 1, r"parallel.tp \(4\) must divide model.n_head \(2\): each TP rank holds whole attention heads"),
    (1, 4, r"parallel.pp \(4\) must divide model.n_layer \(2\): pipeline stages hold equal numbers of layers"),
])
def test_the_built_in_trainer_refuses_a_layout_its_model_cannot_split(tp: int, pp: int, words: str) -> None:
    assert check(JobSpec(name="builtin", slots=4, parallel=ParallelSpec(tp=2, pp=2))).parallel.tp == 2
    with pytest.raises(InvalidSpec, match=words):
        check(JobSpec(name="builtin", slots=4, parallel=ParallelSpec(tp=tp, pp=pp)))


@pytest.mark.parametrize(("tp", "pp", "slots", "batch"), [(2, 2, 4, 8), (2, 2, 4, 16), (1, 2, 2, 8), (2, 1, 4, 8),
                                                          (1, 1, 2, 8), (2, 2, 8, 16)])
def test_a_run_without_a_plan_splits_its_batch_as_the_planner_does(tp: int, pp: int, slots: int, batch: int) -> None:
    """The same script alone and on the platform sums the same micro-batches, so they train bitwise alike
    (issue 52: the built-in TP x PP trainer ran 2 micro-batches alone and 8 on the platform, and parted at step 0)."""
    nodes = [cpu(f"n{i}") for i in range(slots // 2)]
    _, outs = fold(SERVICE, [*nodes, asking(tp, pp, slots=slots, batch=batch),
                             grant({f"n{i}": 2 for i in range(slots // 2)})])
    (planned,) = events_of(outs, ReshardPlanned)
    alone = unplanned(slots, tp, pp, batch)
    assert (layout(alone), alone.micro_batches, alone.grad_accum, alone.micro_batch_size) == \
        (layout(planned.new), planned.new.micro_batches, planned.new.grad_accum, planned.new.micro_batch_size)
