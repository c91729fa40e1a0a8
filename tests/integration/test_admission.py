"""One admission rule for every reader (events/admission.py), on a real broker: a forged or unnumbered event on one
job's subject is refused by the services and by every view alike, and never stalls the service for other jobs."""

import pytest

from flightdeck.events import subjects
from flightdeck.events.clock import DeadLettered
from flightdeck.events.codec import encode
from flightdeck.events.findings import StragglerDetected
from flightdeck.events.history import read_job
from flightdeck.events.job import JobCompleted, JobSubmitted
from flightdeck.events.spec import JobSpec
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.client import Client
from flightdeck.services.tools.history.library import History
from flightdeck.services.tools.history.read import job_rows
from tests.integration import toy_service
from tests.integration.runtime_helpers import Bus, bus_at, eventually, read_all, submissions
from tests.integration.test_runtime import start, stop_service

pytestmark = pytest.mark.timeout(60)


async def answered_jobs(bus: Bus, jobs: list[str]) -> bool:
    return all([await bus.store.last(subjects.CONTROL, subjects.job(j, "JobQueued")) is not None for j in jobs])


async def test_an_unnumbered_event_on_one_job_is_dead_lettered_and_every_other_job_goes_on(
        nats_server: broker_mod.Broker) -> None:
    """Trial 3 (86ea31b): one StragglerDetected with job_version 0 on job A's subject made the scheduler and the
    checkpoint service retry a HistoryGap for ever: A never completed and an untouched job B stalled."""
    async with bus_at(nats_server.url) as bus:
        task, stop = start(toy_service.build, nats_server.url)
        await bus.store.append_batch(submissions(1, "a"))
        await eventually(lambda: answered_jobs(bus, ["a0"]), 20, "job a0 queued")
        # Unnumbered, straight onto a0's fenced subjects: the last message a writer numbers from, then one the
        # toy folds and would answer on a0's history.
        straggler = StragglerDetected(job_id="a0", rank=0, attempt=0, step_time_s=9.0, peer_median_s=1.0, factor=9.0)
        await bus.js.publish(subjects.job("a0", "StragglerDetected"), encode(straggler))
        forged = JobSubmitted(job_id="a0", spec=JobSpec(name="toy"), event_id="forged")
        await bus.js.publish(subjects.job("a0", "JobSubmitted"), encode(forged))
        await bus.store.append_batch(submissions(2, "b"))
        await eventually(lambda: answered_jobs(bus, ["b0", "b1"]), 20, "the jobs submitted after the poison")
        assert not task.done()
        dead = [s.event for s in await read_all(bus.store, subjects.DEAD)]
        assert [(d.subject, d.reason.split(":")[0]) for d in dead if isinstance(d, DeadLettered)] == [
            (subjects.job("a0", "JobSubmitted"), "invalid")]
        history = await read_job(bus.store, "a0")  # contiguous over what is admitted: no HistoryGap
        assert [type(s.event).__name__ for s in history] == ["JobSubmitted", "JobQueued", "StragglerDetected",
                                                             "JobSubmitted"]
        fd = Client(bus.store, nats_server.url)  # the bus closes the store
        assert [type(e).__name__ for e in await fd.history("a0")] == ["JobSubmitted", "JobQueued"]
        await stop_service(task, stop)


async def test_views_fold_only_what_the_services_admit(nats_server: broker_mod.Broker) -> None:
    """Trial 5 (86ea31b): a JobCompleted naming another job, sent on t5-one's subject, was dead-lettered by every
    service, yet `status` and `replay` showed t5-one completed while it kept training."""
    async with bus_at(nats_server.url) as bus:
        fd = Client(bus.store, nats_server.url)
        job = await fd.submit(JobSpec(name="t5"))
        other = JobCompleted(job_id="t5-other", steps=100, event_id="forged-end", job_version=2)
        await bus.js.publish(subjects.job(job, "JobCompleted"), encode(other))
        unnumbered = JobCompleted(job_id=job, steps=100, event_id="unnumbered-end")
        await bus.js.publish(subjects.job(job, "JobCompleted"), encode(unnumbered))
        assert (await fd.status(job)).phase == "submitted"
        assert [type(e).__name__ for e in await fd.history(job)] == ["JobSubmitted"]
        history = History(job_id=job, rows=await job_rows(bus.store, job), source="test")
        assert [type(s.event).__name__ for s in history.job_control()] == ["JobSubmitted"]
        with pytest.raises(TimeoutError):  # a follower does not end on the forged ends either
            await fd.wait(job, timeout_s=1.0)
        assert [v.phase for v in await fd.jobs()] == ["submitted"]

