"""A restore the uninterrupted run may not equal bitwise is never silent (issue 52): the rank says why in its
RankStarted (trainer/exactness.py), the health monitor records it once per attempt (InexactRestore), and status and
the postmortem show it."""

from flightdeck.events.findings import InexactRestore
from flightdeck.events.training import RankStarted
from flightdeck.services.tools.console.status import details
from flightdeck.services.tools.history import jobview
from flightdeck.trainer.exactness import why_inexact
from tests.unit.health_synth import Cluster, RankPlan, fold
from tests.unit.test_health_core import POLICY


def test_only_another_layout_or_a_borrowed_extra_makes_a_restore_inexact() -> None:
    same = {"world_size": 4, "layout": [1, 2, 2]}
    assert why_inexact(same, 4, (1, 2, 2), {}) == ""
    assert why_inexact({"world_size": 2}, 2, (2, 1, 1), {}) == ""  # a checkpoint of before layouts were saved
    assert why_inexact(same, 2, (1, 2, 1), {}).startswith("saved by 4 ranks, restored into 2")
    assert why_inexact(same, 4, (2, 2, 1), {}).startswith("saved as DP x TP x PP 1 x 2 x 2, restored as 2 x 2 x 1")
    borrowed = why_inexact(same, 4, (1, 2, 2), {"loader": 0})
    assert "restored from another rank's: loader (rank 0's)" in borrowed


def test_the_health_monitor_records_an_inexact_restore_once_per_attempt_and_status_shows_it() -> None:
    c = Cluster(num_ranks=2, policy=POLICY)
    c.start()
    c.run([RankPlan(step_time_s=lambda s: 0.5)] * 2, start=0.0, until=3.0, announce=False)
    why = "saved by 4 ranks, restored into 2: the gradients' sums run in another order"
    for rank in (0, 1):
        c.events.append(RankStarted(job_id=c.job_id, rank=rank, attempt=0, node="n1", world_size=2, from_step=20,
                                    device="cpu", restored_from="store", exactness=why, event_id=f"rs-{rank}",
                                    occurred_at=3.1))
    c.run([RankPlan(step_time_s=lambda s: 0.5)] * 2, start=3.2, until=5.0, first_step=20, announce=False)
    _, found = fold(c.events)
    (inexact,) = [f for f in found if isinstance(f, InexactRestore)]
    assert (inexact.rank, inexact.attempt, inexact.step, inexact.reason, inexact.evidence) == (0, 0, 20, why, ["rs-0"])
    view = jobview.fold(c.job_id, [*c.events[:3], inexact])
    assert view.inexact == f"from step 20 not guaranteed bitwise the uninterrupted run: {why}"
    assert f"exactness:  from step 20 not guaranteed bitwise the uninterrupted run: {why}" in details(view, 10.0)
    exact = jobview.fold(c.job_id, c.events[:3])
    assert "exactness:  exact: no restore parted it from the uninterrupted run" in details(exact, 10.0)
