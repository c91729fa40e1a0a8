"""Service-by-service upgrade (docs/deploy.md): one service is stopped while a job runs, the others keep
working, events pile up in its durable consumer, and the restarted service catches up and decides exactly
what its core decides from the log: every recorded decision equals a replay of its inputs, none is
missing, none was made twice."""

from pathlib import Path

import pytest

from flightdeck.events.job import AllocationReleased, JobCompleted, WorkersExited, WorkersStarted
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.services import registry
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.fold import comparable, replay
from tests.e2e.drill_harness import export
from tests.integration.lifecycle_harness import Objects, open_platform
from tests.integration.test_lifecycle_services import kinds

JOB = "upgrade-000001"
SPEC = JobSpec(name="upgrade", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=30, checkpoint_every=10, data="synthetic"))


@pytest.mark.timeout(150)
async def test_a_stopped_scheduler_catches_up_from_its_durable_consumer(nats_server: broker_mod.Broker,
                                                                         tmp_path: Path) -> None:
    p = await open_platform(nats_server.url, tmp_path, Objects(str(tmp_path / "objects")))
    try:
        p.start_all()
        await p.ready()
        await p.submit(SPEC, JOB)
        await p.until(lambda: bool(p.seen(WorkersStarted, JOB)), 60, "the ranks to start", JOB)
        # Upgrade window: the scheduler goes down while the ranks are still importing torch.
        assert p.stop("scheduler") == 0
        down_at = len(p.control)
        await p.until(lambda: len(p.seen(WorkersExited, JOB)) == 2, 90, "both ranks to finish", JOB)
        assert not p.seen(JobCompleted, JOB), "no one but the scheduler decides a job is complete"
        assert len(p.control) > down_at  # the others kept working: exits, checkpoints, ticks
        p.service("scheduler")  # the "upgraded" scheduler
        await p.until(lambda: bool(p.seen(JobCompleted, JOB)) and bool(p.seen(AllocationReleased, JOB)), 60,
                      "the restarted scheduler to complete the job", JOB)
        assert kinds(p.job(JOB))[-2:] == ["JobCompleted", "AllocationReleased"]

        recorded = {s.stored.msg_id: s.stored.event for s in p.control
                    if s.stored.event is not None and s.stored.event.producer == "scheduler"
                    and not s.stored.subject.startswith("fd.ctl.clock.")}
        assert len(recorded) == len([s for s in p.control if s.stored.msg_id in recorded])  # none made twice
        replayed = {out.msg_id: out.event async for step in replay(registry.build("scheduler"), p.store)
                    for out in step.outputs}
        assert len(recorded) >= 4 and set(replayed) == set(recorded)  # queued, requested, completed, released
        for mid, event in recorded.items():
            assert comparable(replayed[mid]) == comparable(event), mid
    finally:
        try:  # the history, kept whether it passed or not: a loaded suite run once recorded an output no replay made
            await export(p, JOB, tmp_path / f"{JOB}.history.jsonl")
        finally:
            await p.close()
