"""Properties of the recipes: the batch walk agrees with the trainer's token stream, and the scheduler's
invariants (tests/unit/test_scheduler_invariants.py) hold with findings, commits and rollbacks mixed into
random traffic, every rollback naming a live checkpoint at or before its trigger's step."""

from typing import Any

import msgspec
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss, StragglerDetected
from flightdeck.events.job import AllocationRequested, JobCancelled, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import RolledBack
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.scheduler.recipes import batch_after
from flightdeck.trainer.cursor import BatchCursor
from tests.unit.helpers import Agents, Bus, Fleet, register, step
from tests.unit.test_scheduler_invariants import check

WINDOWS = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 30)).map(lambda w: (w[0], w[0] + w[1])), max_size=4)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 40), windows=WINDOWS, n=st.integers(0, 80))
def test_the_batch_walk_is_the_trainer_s(start: int, windows: list[tuple[int, int]], n: int) -> None:
    stream = BatchCursor()
    stream.seek(DataPosition(next_batch=start, skipped=windows))
    read = [stream.next_index() for _ in range(n + 1)]
    assert batch_after(DataPosition(next_batch=start, skipped=windows), (), n) == read[-1]
    assert batch_after(DataPosition(next_batch=start), tuple(windows), n) == read[-1]


KINDS = ["submit", "finish", "crash", "cancel", "lose", "lose", "add", "uncordon", "uncordon", "tick",
         "commit", "commit", "commit", "spike", "nan", "straggle", "land", "land", "delete"]
ACTIONS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 9), st.integers(1, 4)), min_size=5, max_size=40)


def submitted(n: int, slots: int, x: int, floor: int | None = None) -> JobSubmitted:
    """A job whose policy varies with `x`; with `floor`, one that may shrink to it and restarts 3 times."""
    policy = PolicySpec(max_restarts=x % 3 if floor is None else 3, replace_stragglers=x % 2 == 0,
                        min_slots=x % (slots + 1) if floor is None else floor,
                        rollback_steps_back=x * 3, rollback_skip_batches=x * 5)
    return JobSubmitted(job_id=f"j{n}-1", spec=JobSpec(name=f"j{n}", slots=slots, priority=x * 10,
                                                       train=TrainSpec(batch_size=8, checkpoint_every=10),
                                                       policy=policy))


def telemetry(b: Bus, ev: Event) -> None:
    """Telemetry reaches only the scheduler (the Bus routes control subjects); its outputs join the log."""
    i = [s.name for s in b.services].index("scheduler")
    b.clock += 1.0
    ev = msgspec.structs.replace(ev, event_id=f"tel:{len(b.log)}", occurred_at=b.clock)
    b.states[i], outs = step(b.services[i], b.states[i], ev)
    for n, out in enumerate(outs):
        b.log.append(msgspec.structs.replace(out.event, event_id=f"scheduler:tel{len(b.log)}:{n}",
                                             occurred_at=ev.occurred_at, causation_id=ev.event_id,
                                             producer="scheduler"))
    b.pump()


def check_rollbacks(b: Bus) -> None:
    live: dict[str, dict[str, int]] = {}
    steps = {e.event_id: e.step for e in b.log if isinstance(e, LossSpikeDetected | NonFiniteLoss)}
    for e in b.log:
        match e:
            case CheckpointCommitted():
                live.setdefault(e.job_id, {})[e.checkpoint_id] = e.step
            case CheckpointDeleted():
                live.get(e.job_id, {}).pop(e.checkpoint_id, None)
            case RollbackRequested():
                assert live[e.job_id].get(e.checkpoint_id) == e.to_step <= steps[e.trigger_id], e
                assert e.skip_from <= e.skip_to and e.trigger_id in e.reason
            case JobFailed():
                assert e.causes, e


@settings(max_examples=150, deadline=None)
@given(first=st.tuples(st.integers(0, 9), st.integers(0, 9)), actions=ACTIONS, spare=st.booleans())
def test_invariants_hold_with_findings_and_rollbacks_in_the_traffic(first: tuple[int, int],
                                                                    actions: list[tuple[str, int, int]],
                                                                    spare: bool) -> None:
    b = Bus([scheduler(stop_timeout_s=5.0, landing_timeout_s=5.0, memory_wait=False), resources()])
    agents = Agents(b)
    b.publish(register("n0", 2), register("n1", 2), *([register("spare", 2, spare=True)] if spare else []))
    b.publish(submitted(0, 3, first[0], floor=1 + first[0] % 2), submitted(1, 1, first[1]))  # these run at once
    submissions, progress = 2, dict[str, int]()
    fleet = Fleet(b, agents, nodes=3)
    agents()
    for kind, x, y in actions:
        running = sorted(agents.running)
        target = running[x % len(running)] if running else ""
        grant = agents.running.get(target)
        match kind:
            case "submit":
                b.publish(submitted(submissions, y, x))
                submissions += 1
            case "finish" | "crash" | "cancel" | "lose" | "add" | "uncordon" | "tick":
                fleet.act(kind, x, y)
            case "commit" if grant:
                done = progress[target] = progress.get(target, 0) + 10 * y
                b.publish(CheckpointCommitted(job_id=target, checkpoint_id=f"c{done}-{len(b.log)}", step=done,
                                              world_size=len(grant.assignments), uri="u", bytes=1,
                                              data=DataPosition(next_batch=done)))
            case "spike" | "nan" if grant:
                where: dict[str, Any] = {"job_id": target, "rank": y % len(grant.assignments), "attempt": grant.attempt,
                         "step": progress.get(target, 0) + x - 2}
                b.publish(LossSpikeDetected(loss=9.0, baseline=1.0, mad=0.1, z=80.0, threshold=6.0, **where)
                          if kind == "spike" else NonFiniteLoss(loss=float("nan"), grad_norm=1.0, **where))
            case "straggle" if grant:
                b.publish(StragglerDetected(job_id=target, rank=y % len(grant.assignments), attempt=grant.attempt,
                                            step_time_s=1.0, peer_median_s=0.2, factor=5.0))
            case "land" if b.of(RollbackRequested):
                rb = b.of(RollbackRequested)[-1]  # the newest rollback lands, if its job still runs
                if rb.job_id in agents.running:
                    telemetry(b, RolledBack(job_id=rb.job_id, rank=0, attempt=agents.running[rb.job_id].attempt,
                                            checkpoint_id=rb.checkpoint_id, to_step=rb.to_step,
                                            skip_from=rb.skip_from, skip_to=rb.skip_to))
            case "delete" if grant:
                commits = [e for e in b.of(CheckpointCommitted, target)]
                if commits:
                    b.publish(CheckpointDeleted(job_id=target, checkpoint_id=commits[0].checkpoint_id))
        agents()
        check(b.state("scheduler"), b)
    check_rollbacks(b)
    for name, seen in (("rolled back", b.of(RollbackRequested)),
                       ("widened", [e for e in b.of(RollbackRequested) if "widened" in e.reason]),
                       ("failed on spikes", [e for e in b.of(JobFailed) if "spiked" in e.reason]),
                       ("shrunk", [e for e in b.of(AllocationRequested) if e.reason.startswith("shrink")]),
                       ("grew back", [e for e in b.of(AllocationRequested) if e.reason == "grow back"])):
        if seen:
            event(name)
    # Then plenty of room and well-behaved ranks: every job must get to an end (no job is stuck).
    b.publish(register("big", 8))
    for _ in range(4 * submissions + 1):
        if agents.running:
            agents.finish(sorted(agents.running)[0])
        agents()
    assert b.state("scheduler").jobs == {}
    ends = [e.job_id for e in b.log if isinstance(e, JobCompleted | JobFailed | JobCancelled)]
    assert len(ends) == len(set(ends)) == submissions
