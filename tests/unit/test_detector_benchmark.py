"""The detector benchmark's fast subset (bench/detectors, issue 32): on every recorded fault-free curve of the
shipped examples and the built-in trainer, and one synthetic curve of each healthy shape, the spike rule makes no
finding at all; every injected spike of x2 or more lasting 3 steps or more is found where the curve's own noise
leaves it visible; and the rule shipped before makes the very false finding issue 32 reported."""

import math

from bench.detectors.__main__ import Shipped
from bench.detectors.baseline import SingleStepZ
from bench.detectors.corpus import SHAPES, recorded, synthetic, trials
from bench.detectors.score import QUIET, findings, score
from bench.detectors.timing import measure
from flightdeck.events.spec import PolicySpec

RECORDED = {"pytorch_ddp", "fsdp2", "hf_causal_lm", "builtin-b8-lr3e-3-s1", "builtin-b2-lr1e-2-s2",
            "builtin-b16-lr1e-3-s3", "builtin-b4-lr3e-3-s4-synthetic"}


def test_no_false_finding_on_any_fault_free_curve_and_every_visible_spike_found() -> None:
    curves = recorded() + synthetic(1)
    assert {c.name for c in curves if c.kind == "recorded"} == RECORDED
    assert all(len(c.loss) == 3000 for c in curves)
    s = score("shipped", lambda: Shipped(PolicySpec()), trials(curves, positions=1))
    assert (s.clean_curves, s.clean_false, s.injected_false) == (len(curves), 0, 0), s.clean_false_curves
    for shape in SHAPES:
        got = s.shapes[shape.name]
        assert got.trials == len(curves)
        if shape.must_find:
            assert got.quiet_trials >= 9 and got.quiet_found == got.quiet_trials, (shape.name, got.missed)
            assert sorted(got.delays)[len(got.delays) // 2] <= 5 and max(got.delays) < shape.length + 10, got.delays
    assert s.shapes["one step x10"].found == 0  # a lone step is never a spike on its own


def test_the_rule_shipped_before_rolled_the_healthy_ddp_example_back_where_issue_32_says() -> None:
    (ddp,) = [c for c in recorded() if c.name == "pytorch_ddp"]
    assert ddp.noise > QUIET  # its per-batch loss moves by about half from one step to the next
    old = findings(SingleStepZ(), ddp.loss, ddp.lr)
    assert old[0] == 731 and len(old) >= 2  # "LossSpikeDetected at step 731: loss 0.573 against a median of 0.137"
    assert math.isclose(ddp.loss[731], 0.5733, abs_tol=1e-3)
    assert findings(Shipped(PolicySpec()), ddp.loss, ddp.lr) == []


def test_the_hang_and_straggler_rules_make_no_finding_on_the_recorded_step_times_and_find_a_slow_rank() -> None:
    rows = measure(PolicySpec())
    assert set(rows) == RECORDED
    for name, row in rows.items():
        assert row["false_hangs"] == 0 and row["hang_delay_s"] == PolicySpec().hang_min_s, (name, row)
        if row["ranks"] == 2:
            assert row["false_stragglers"] == 0, (name, row)
            found = row["slow_rank_x3_found_after_steps"]
            assert isinstance(found, int) and PolicySpec().straggler_window <= found <= 40, (name, row)
    # the floor is what keeps the deadline off a checkpoint write or a loaded box's slow step
    assert sum(int(str(r["false_hangs_without_the_floor"])) for r in rows.values()) > 0
