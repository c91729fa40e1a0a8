"""The restore rule, one function for the scheduler (which chooses what a restart restores and records it) and
adoption (events/lineage.newest): the highest step no rollback threw away, and among equal steps the one committed
last. The scheduler once picked the first of two checkpoints of one step committed at the same time where the agents
(which then chose for themselves) picked the last."""

from flightdeck.events import lineage
from flightdeck.services.scheduler.state import Checkpoint, Job
from tests.unit.helpers import submit


def test_the_highest_standing_step_and_among_equals_the_last_committed() -> None:
    forks = (lineage.Fork(attempt=0, timeline=1, to_step=20),)  # a rollback of attempt 0 back to step 20
    kept = [Checkpoint(checkpoint_id="a-20", step=20, at=5.0), Checkpoint(checkpoint_id="a-30", step=30, at=5.0),
            Checkpoint(checkpoint_id="b-25", step=25, at=5.0, attempt=1),  # 30: thrown away
            Checkpoint(checkpoint_id="m-25", step=25, at=5.0, attempt=1)]
    assert lineage.newest(kept, forks) == kept[3]
    assert lineage.newest(kept, ()) == kept[1]
    assert lineage.newest([], forks) is None
    job = Job(job_id="j", spec=submit("j", slots=1).spec, order=0, forks=forks, checkpoints=tuple(kept))
    assert job.newest is not None and job.newest.checkpoint_id == "m-25"
