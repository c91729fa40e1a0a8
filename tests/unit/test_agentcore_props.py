"""Properties of the agent core over any order of grants, releases, ends and commits (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition
from flightdeck.events.job import AllocationGranted, AllocationReleased, JobCancelled, JobFailed, JobSubmitted, SlotRef
from flightdeck.events.spec import JobSpec
from flightdeck.services.agent import core as agentcore
from flightdeck.services.agent.core import SPAWN, STOP, SpawnArgs, State, StopArgs
from flightdeck.services.core import Effect

JOBS = ("j", "k")


@st.composite
def an_event(draw: st.DrawFn) -> Event:
    job = draw(st.sampled_from(JOBS))
    attempt = draw(st.integers(0, 3))
    match draw(st.sampled_from(["grant", "grant", "release", "cancel", "fail", "commit"])):
        case "grant":
            nodes = draw(st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=3))
            refs = [SlotRef(node=n, slot=i, rank=i) for i, n in enumerate(nodes)]
            return AllocationGranted(job_id=job, attempt=attempt, assignments=refs)
        case "release":
            return AllocationReleased(job_id=job, attempt=attempt)
        case "cancel":
            return JobCancelled(job_id=job)
        case "fail":
            return JobFailed(job_id=job, reason="budget")
        case _:
            step = draw(st.integers(0, 50))
            return CheckpointCommitted(job_id=job, checkpoint_id=f"s{step}-a{attempt}", step=step, world_size=1,
                                       uri="", bytes=0, data=DataPosition(next_batch=step))


def fold(events: list[Event]) -> tuple[State, list[Effect]]:
    state = State(node="a")
    effects: list[Effect] = []
    for ev in [*(JobSubmitted(job_id=j, spec=JobSpec(name=j)) for j in JOBS), *events]:
        state, outs = agentcore.transition(state, ev)
        effects.extend(o for o in outs if isinstance(o, Effect))
    return state, effects


@settings(max_examples=300, deadline=None)
@given(st.lists(an_event(), max_size=30))
def test_one_attempt_per_job_runs_here_and_the_old_one_is_stopped_first(events: list[Event]) -> None:
    state, effects = fold(events)
    running: dict[str, int] = {}
    newest: dict[str, int] = {}
    ended: set[str] = set()
    for ev in events:
        if isinstance(ev, JobCancelled | JobFailed):
            ended.add(ev.job_id)
    for effect in effects:
        if effect.kind == SPAWN:
            args = effect.args
            assert isinstance(args, SpawnArgs)
            assert args.job_id not in running, "an attempt started while the previous one still ran here"
            assert args.attempt > newest.get(args.job_id, -1), "attempts start in increasing order, each once"
            assert args.ranks and all(r.node == "a" for r in args.ranks)
            running[args.job_id] = newest[args.job_id] = args.attempt
        elif effect.kind == STOP:
            stop = effect.args
            assert isinstance(stop, StopArgs)
            assert running.get(stop.job_id) == stop.attempt, "a stop names the attempt that runs here"
            del running[stop.job_id]
    for job in JOBS:
        held = state.jobs[job].held if job in state.jobs else None
        assert (held.attempt if held else None) == running.get(job)
    assert not (set(running) & ended), "an ended job keeps no ranks"
    assert fold(events) == (state, effects)  # a replay decides the same
