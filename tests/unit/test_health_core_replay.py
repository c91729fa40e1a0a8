"""The health core under services/shell/fold.py: recorded control events, telemetry and ticks replay to the
findings that were recorded, from scratch or from a rebuild half way."""

import math

from flightdeck.events import subjects
from flightdeck.events.base import Event, JobEvent
from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import Finding, LossSpikeDetected, RankHung, RankLost
from flightdeck.events.history import append_to_job
from flightdeck.events.spec import PolicySpec
from flightdeck.events.store import MemoryStore
from flightdeck.events.training import StepCompleted
from flightdeck.services.health.core import TELEMETRY_TYPES
from flightdeck.services.shell.fold import comparable, outputs_of, rebuild, replay
from tests.unit.health_synth import SERVICE, Cluster, RankPlan, fold, loss_curve

POLICY = PolicySpec(heartbeat_interval_s=1.0, heartbeat_misses=3, hang_min_s=4.0, hang_factor=10.0, spike_warmup=10)


def scenario() -> Cluster:
    c = Cluster(num_ranks=3, policy=POLICY)
    c.loss = lambda rank, step: loss_curve(step) * (5.0 if 30 <= step < 33 else 1.0) + 0.01 * math.sin(step * 3 + rank)
    c.start()
    c.run([RankPlan(step_time_s=lambda s: 0.25), RankPlan(step_time_s=lambda s: 0.25, dies_at=20.0),
           RankPlan(step_time_s=lambda s: 0.25, hangs_at_step=60)], start=0.0, until=40.0)
    return c


def decision(event: Event) -> dict[str, object]:
    """What a core decides, without the envelope the shell stamps."""
    fields = comparable(event)
    for key in ("event_id", "occurred_at", "causation_id", "producer"):
        fields.pop(key)
    return fields


async def record(events: list[Event]) -> MemoryStore:
    """Store inputs as a live run would: telemetry on FD_TELEMETRY, each tick naming how far it had read."""
    store = MemoryStore()
    telemetry_seq = 0
    for ev in events:
        name = type(ev).__name__
        if isinstance(ev, ClockTick):
            ev = ClockTick(service=ev.service, now=ev.now, positions={subjects.TELEMETRY: telemetry_seq},
                           event_id=ev.event_id, occurred_at=ev.occurred_at)
            await store.append(subjects.clock(ev.service), ev)
        elif name in TELEMETRY_TYPES:
            assert isinstance(ev, StepCompleted) or hasattr(ev, "rank")
            telemetry_seq = (await store.append(subjects.telemetry(ev.job_id, ev.rank, name), ev)).seq  # type: ignore[attr-defined]
        else:
            assert isinstance(ev, JobEvent)
            await append_to_job(store, ev)
    return store


async def test_replay_gives_the_recorded_findings_from_scratch_and_from_a_rebuild() -> None:
    c = scenario()
    direct = fold(c.events)[1]
    kinds = sorted(type(f).__name__ for f in direct)
    assert kinds == ["LossSpikeDetected", "RankHung", "RankLost"], kinds
    store = await record(c.events)

    live = outputs_of([s async for s in replay(SERVICE, store)])
    assert [decision(o.event) for o in live] == [decision(f) for f in direct]
    for out in live:  # what the shell does with them
        assert isinstance(out.event, Finding)
        await append_to_job(store, out.event, msg_id=out.msg_id)
    recorded = [s.event for batch in [b async for b in store.read(subjects.CONTROL, ("fd.ctl.job.*.RankLost",
                "fd.ctl.job.*.RankHung", "fd.ctl.job.*.LossSpikeDetected"))] for s in batch]
    assert len(recorded) == 3

    again = outputs_of([s async for s in replay(SERVICE, store)])
    assert [o.msg_id for o in again] == [o.msg_id for o in live]
    by_id = {e.event_id: e for e in recorded if e is not None}
    assert all(comparable(by_id[o.msg_id]) == comparable(o.event) for o in again)

    last_control = max(s.seq for b in [b async for b in store.read(subjects.CONTROL)] for s in b)
    for until in (last_control // 3, last_control // 2, 2 * last_control // 3):
        head = outputs_of([s async for s in replay(SERVICE, store, until=until)])
        folder = await rebuild(SERVICE, store, until=until)
        rest = outputs_of([s async for s in replay(SERVICE, store, folder=folder)])
        assert [o.msg_id for o in head + rest] == [o.msg_id for o in live]


async def test_findings_are_stamped_by_the_input_that_decided_them() -> None:
    c = scenario()
    store = await record(c.events)
    steps = [s async for s in replay(SERVICE, store)]
    for step in steps:
        for out in step.outputs:
            assert step.input.event is not None and out.event.causation_id == step.input.event.event_id
            if isinstance(out.event, RankLost | RankHung):
                assert isinstance(step.input.event, ClockTick)  # silence and hangs are judged at ticks
            if isinstance(out.event, LossSpikeDetected):
                assert isinstance(step.input.event, StepCompleted) and step.input.stream == subjects.TELEMETRY
    assert not any(s.error for s in steps)
