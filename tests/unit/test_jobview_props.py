"""Property: whatever happens to a fleet of jobs, the phase, restart count and attempt that `flightdeck status`
reads back from each job's history are the ones the scheduler holds in memory."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.clock import ClockTick
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import CancelRequested, WorkersExited
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.tools.history import jobview
from tests.unit.helpers import Agents, Bus, register, submit

Action = tuple[str, int, int]  # (what, which, how)

actions = st.lists(st.tuples(st.sampled_from(["submit", "start", "crash", "finish", "cancel", "lose", "join", "tick"]),
                             st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=30)


def apply(b: Bus, agents: Agents, action: Action, jobs: list[str], nodes: list[str]) -> None:
    what, which, how = action
    running = sorted(agents.running)
    match what:
        case "submit":
            job_id = f"j{len(jobs)}-x"
            jobs.append(job_id)
            b.publish(submit(job_id, slots=1 + how % 3, priority=(10, 50, 90)[which % 3], max_restarts=which % 3))
        case "start":
            agents()
        case "crash" if running:
            grant = agents.running[running[which % len(running)]]
            ref = grant.assignments[how % len(grant.assignments)]
            b.publish(WorkersExited(job_id=grant.job_id, node=ref.node, attempt=grant.attempt, rank=ref.rank,
                                    exit_code=(1, -9)[how % 2]))
        case "finish" if running:
            agents.finish(running[which % len(running)])
        case "cancel" if jobs:
            b.publish(CancelRequested(job_id=jobs[which % len(jobs)]))
        case "lose" if nodes:
            b.publish(NodeLost(node=nodes.pop(which % len(nodes)), reason="drill"))
        case "join":
            nodes.append(f"n{len(nodes)}-{which}{how}")
            b.publish(register(nodes[-1], 1 + how % 3))
        case "tick":
            b.publish(ClockTick(service="scheduler", now=b.clock + 1000.0, positions={}))


@settings(max_examples=150, deadline=None)
@given(actions=actions)
def test_the_view_agrees_with_the_scheduler_after_every_input(actions: list[Action]) -> None:
    b = Bus([scheduler(), resources()])
    nodes = ["n0", "n1"]
    b.publish(*(register(n, 2) for n in nodes))
    agents, jobs = Agents(b), []
    for action in actions:
        apply(b, agents, action, jobs, nodes)
        state = b.state("scheduler")
        for job_id in jobs:
            v = jobview.fold(job_id, [e for e in b.log if getattr(e, "job_id", None) == job_id])
            if job_id in state.ended:
                assert v.phase == state.ended[job_id], (job_id, action)
                continue
            job = state.jobs[job_id]
            assert (v.phase, v.restarts, v.attempt) == (job.phase, job.restarts, job.attempt), (job_id, action)
            assert v.world_size == len(job.run.assignments) and v.granted == job.ranks, (job_id, action)
