"""A job started from another job's checkpoint (spec init_from, `submit --resume-from`): the client chooses the
checkpoint by the rule a restart of that job follows (services/tools/history/adoption.py), and the node agents
restore exactly that one until the new job has its own (services/agent/core.adopted). Before, nothing did this:
`resume` and `rollback` refused a failed job, and users loaded another job's store folder by hand."""

import msgspec
import pytest

from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import AllocationGranted, JobSubmitted, RestorePoint, SlotRef
from flightdeck.events.spec import InitFrom, JobSpec, TrainSpec
from flightdeck.services.agent import core as agentcore
from flightdeck.services.agent.core import Restore, SpawnArgs, State
from flightdeck.services.tools.cli import UserError
from flightdeck.services.tools.history.adoption import continuing, resolved
from flightdeck.services.tools.history.jobview import JobView
from tests.unit.test_agentcore import committed

SPEC = JobSpec(name="j", slots=1, train=TrainSpec(steps=50, data="synthetic"))
FAILED = JobView(job_id="old", phase="failed")


def history() -> list[object]:
    rollback = RollbackRequested(job_id="old", checkpoint_id="c10", to_step=10, skip_from=12, skip_to=14,
                                 reason="spike", attempt=0)
    return [JobSubmitted(job_id="old", spec=SPEC), committed("c10", 10, job="old"), committed("c20", 20, job="old"),
            rollback,  # the step-20 checkpoint is thrown away by the rollback to 10
            msgspec.structs.replace(committed("c15", 15, job="old"), timeline=1),
            msgspec.structs.replace(committed("c25", 25, job="old"), timeline=1)]


def test_the_newest_checkpoint_a_restart_would_take_is_adopted_and_at_or_before_a_step() -> None:
    init = resolved(InitFrom(job="old"), FAILED, history())
    assert (init.checkpoint_id, init.checkpoint_step, init.manifest_sha256) == ("c25", 25, "sha-c25")
    assert resolved(InitFrom(job="old", step=24), FAILED, history()).checkpoint_id == "c15"
    assert resolved(InitFrom(job="old", step=12), FAILED, history()).checkpoint_id == "c10"
    with pytest.raises(UserError, match="old has no good committed checkpoint at or before step 9"):
        resolved(InitFrom(job="old", step=9), FAILED, history())
    with pytest.raises(UserError, match="old is running: a job starts only from an ended job's checkpoint"):
        resolved(InitFrom(job="old"), JobView(job_id="old", phase="running"), history())


def test_a_continuation_is_the_old_job_s_spec_without_its_drill() -> None:
    spec = continuing("old", [JobSubmitted(job_id="old", spec=msgspec.structs.replace(SPEC, faults=[]))])
    assert spec.init_from == InitFrom(job="old", what="all") and spec.faults == [] and spec.train == SPEC.train
    with pytest.raises(UserError, match="no job 'gone'"):
        continuing("gone", [])


def test_the_agents_restore_the_adopted_checkpoint_until_the_job_has_its_own() -> None:
    init = InitFrom(job="old", what="model", checkpoint_id="c25", checkpoint_step=25, manifest_sha256="sha-c25")
    spec = msgspec.structs.replace(SPEC, init_from=init)
    state = State(node="a")
    grant = AllocationGranted(job_id="new", attempt=0, assignments=[SlotRef(node="a", slot=0, rank=0)],
                              event_id="g0")
    state, outs = agentcore.transition(state, JobSubmitted(job_id="new", spec=spec))
    state, outs = agentcore.transition(state, grant)
    (spawn,) = [o for o in outs if isinstance(getattr(o, "args", None), SpawnArgs)]
    assert spawn.args.restore == Restore(checkpoint_id="c25", step=25, manifest_sha256="sha-c25", job_id="old",
                                         model_only=True)
    state, _ = agentcore.transition(state, committed("n5", 5, job="new"))
    own = RestorePoint(checkpoint_id="n5", step=5, manifest_sha256="sha-n5")  # the scheduler's choice, in the grant
    state, outs = agentcore.transition(state, msgspec.structs.replace(grant, attempt=1, event_id="g1", restore=own,
                                                                         restore_chosen=True))
    (spawn,) = [o for o in outs if isinstance(getattr(o, "args", None), SpawnArgs)]
    assert spawn.args.restore == Restore(checkpoint_id="n5", step=5, manifest_sha256="sha-n5")  # its own now
