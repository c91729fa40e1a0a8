"""`flightdeck watch` folding a job's events: progress with loss and ETA from rank 0's steps, one line per
incident, plain lines without a terminal and a rich bar on one."""

import io

from rich.console import Console

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.job import JobCompleted, JobResumed, JobSubmitted, WorkersExited
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.console.watch_cmd import Bar, Plain, Watch

JOB = "j-000001"
T0 = 1_800_000_000.0


def stored(ev: Event, stream: str = subjects.CONTROL) -> Stored:
    return Stored(stream, 1, "x", b"", ev.event_id, ev)


def step(n: int, at: float, rank: int = 0) -> Stored:
    return stored(StepCompleted(job_id=JOB, rank=rank, step=n, loss=3.0 - n / 100, grad_norm=1.0, lr=1e-3,
                                tokens_per_s=1.0, step_time_s=0.5, occurred_at=at), subjects.TELEMETRY)


def run_job(watch: Watch) -> None:
    watch.show(stored(JobSubmitted(job_id=JOB, spec=JobSpec(name="j", train=TrainSpec(steps=100)), occurred_at=T0)))
    for n in range(40):
        watch.show(step(n, T0 + 1 + n * 0.5))
        watch.show(step(n, T0 + 1 + n * 0.5, rank=1))  # another rank's step moves nothing
    watch.show(stored(WorkersExited(job_id=JOB, node="n1", attempt=0, rank=1, exit_code=3, occurred_at=T0 + 21)))
    watch.show(stored(JobResumed(job_id=JOB, attempt=1, world_size=1, from_step=30, occurred_at=T0 + 23)))
    for n in range(30, 100):
        watch.show(step(n, T0 + 24 + n * 0.5))
    watch.show(stored(JobCompleted(job_id=JOB, steps=100, occurred_at=T0 + 80)))


def test_without_a_terminal_it_prints_a_line_per_tenth_of_the_run_and_each_incident() -> None:
    out = io.StringIO()
    watch = Watch(JOB, Plain(out))
    run_job(watch)
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if line.startswith(f"{JOB} ")]
    assert progress[0] == f"{JOB} submitted: step 0/100"
    assert f"{JOB} submitted: step 10/100, loss 2.91, ETA 45s" in progress  # 90 steps left at 0.5 s a step
    assert len(progress) <= 14
    notes = [line.split(None, 1)[1] for line in lines if not line.startswith(f"{JOB} ")]
    assert notes == ["WorkersExited: rank 1 (attempt 0) on n1 exited with code 3",
                     "JobResumed: attempt 1 on 1 ranks from step 30", "JobCompleted: 100 steps"]  # describe()'s words
    assert watch.view.ended and watch.step == 100


def test_on_a_terminal_it_draws_a_bar_and_prints_incidents_above_it() -> None:
    out = io.StringIO()
    bar = Bar(Console(file=out, force_terminal=True, width=100))
    run_job(Watch(JOB, bar))
    bar.close()
    text = out.getvalue()
    assert "100/100" in text and JOB in text and "completed" in text
    assert "WorkersExited: rank 1 (attempt 0) on n1 exited with code 3" in text
