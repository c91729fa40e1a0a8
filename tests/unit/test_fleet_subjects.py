"""A node agent's own telemetry (subjects.fleet_telemetry): its sign of life while it runs no ranks stands only
under its own node, and no job's telemetry stands under the fleet token (events/admission.py)."""

from flightdeck.events import subjects
from flightdeck.events.admission import mismatch
from flightdeck.events.fleet import AgentAlive
from flightdeck.events.training import StepCompleted


def test_an_agents_sign_of_life_stands_only_under_its_own_node_on_the_fleet_subject() -> None:
    alive = AgentAlive(node="n1", interval_s=5.0)
    assert mismatch(subjects.fleet_telemetry("n1", "AgentAlive"), alive) == ""
    assert "may not stand under" in mismatch(subjects.fleet_telemetry("n2", "AgentAlive"), alive)
    assert "may not stand under" in mismatch(subjects.telemetry("j-000001", 0, "AgentAlive"), alive)
    step = StepCompleted(job_id=subjects.FLEET, rank=0, step=1, loss=1.0, grad_norm=1.0, lr=0.1, tokens_per_s=1.0,
                         step_time_s=0.1)
    assert "may not stand under" in mismatch(f"fd.tel.{subjects.FLEET}.0.StepCompleted", step)  # no job is "_fleet"
