"""The demo's live timeline prints in time order even when a decision, which bears its input's time, is stored after
telemetry from a second later was already read (CI saw 12.7 s printed before three 12.4 s lines)."""

import time

import pytest

from flightdeck.events import subjects
from flightdeck.events.findings import RankLost
from flightdeck.events.job import JobSubmitted
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.console.demo import Timeline


def stored(stream: str, seq: int, event: object) -> Stored:
    return Stored(stream=stream, seq=seq, subject="", data=b"", msg_id="", event=event)  # type: ignore[arg-type]


def test_a_late_decision_still_prints_before_the_later_telemetry(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.time()
    tl = Timeline("j-000001", every=1)
    tl.show(stored(subjects.CONTROL, 1, JobSubmitted(job_id="j-000001", spec=JobSpec(name="j"), occurred_at=t0)))
    for n, at in enumerate((1.0, 2.0, 3.0)):  # telemetry runs ahead: steps at 1, 2 and 3 s
        tl.show(stored(subjects.TELEMETRY, n + 1, StepCompleted(job_id="j-000001", rank=0, step=n, loss=1.0,
                                                               grad_norm=1.0, lr=0.1, tokens_per_s=1.0,
                                                               step_time_s=1.0, occurred_at=t0 + at)))
    # stored now, stamped with its input's time: 1.5 s, before the step at 2 s that was already read
    tl.show(stored(subjects.CONTROL, 2, RankLost(job_id="j-000001", rank=1, attempt=0, reason="exited with code 3",
                                                 last_seen=t0, occurred_at=t0 + 1.5)))
    tl.flush()
    times = [float(line.split()[0].removesuffix("s")) for line in capsys.readouterr().out.splitlines()]
    assert times == [0.0, 1.0, 1.5, 2.0, 3.0]


def test_a_follower_running_a_minute_behind_still_waits_for_the_other_stream(
        capsys: pytest.CaptureFixture[str]) -> None:
    """On a busy box the follower reads everything late: a line's own time is long past, yet the other stream's
    earlier lines are still on their way. Only the time a line has waited since it arrived lets it go alone."""
    t0, now = time.time() - 60, [0.0]
    tl = Timeline("j-000001", every=1, clock=lambda: now[0])
    tl.show(stored(subjects.CONTROL, 1, JobSubmitted(job_id="j-000001", spec=JobSpec(name="j"), occurred_at=t0)))
    tl.show(stored(subjects.CONTROL, 2, RankLost(job_id="j-000001", rank=1, attempt=0, reason="exited with code 3",
                                                 last_seen=t0, occurred_at=t0 + 5.0)))
    now[0] = 1.0  # a second later (of the follower's clock) the telemetry from before the decision arrives
    tl.show(stored(subjects.TELEMETRY, 1, StepCompleted(job_id="j-000001", rank=0, step=0, loss=1.0, grad_norm=1.0,
                                                        lr=0.1, tokens_per_s=1.0, step_time_s=1.0,
                                                        occurred_at=t0 + 4.0)))
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["0.0s"]  # the rest still held
    now[0] = 7.0  # the telemetry went quiet: the decision has waited long enough, and prints after the step
    tl.show(stored(subjects.CONTROL, 3, RankLost(job_id="j-000001", rank=0, attempt=0, reason="exited with code 1",
                                                 last_seen=t0, occurred_at=t0 + 5.1)))
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["4.0s", "5.0s"]
    tl.flush()
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["5.1s"]


def test_telemetry_read_before_the_submission_waits_for_its_time(capsys: pytest.CaptureFixture[str]) -> None:
    """The control follower ran behind: a rank's first step was read before JobSubmitted. It must print seconds
    after the submission, in order, not seconds since 1970 (CI saw that, and its flush carried a later line out
    ahead of earlier ones)."""
    t0, now = time.time(), [0.0]
    tl = Timeline("j-000001", every=1, clock=lambda: now[0])
    tl.show(stored(subjects.TELEMETRY, 1, StepCompleted(job_id="j-000001", rank=0, step=0, loss=1.0, grad_norm=1.0,
                                                        lr=0.1, tokens_per_s=1.0, step_time_s=1.0,
                                                        occurred_at=t0 + 2.0)))
    now[0] = 10.0  # long past the wall hold: it must not go out alone with an unknown time
    tl.show(stored(subjects.TELEMETRY, 2, StepCompleted(job_id="j-000001", rank=0, step=1, loss=1.0, grad_norm=1.0,
                                                        lr=0.1, tokens_per_s=1.0, step_time_s=1.0,
                                                        occurred_at=t0 + 3.0)))
    assert capsys.readouterr().out == ""
    tl.show(stored(subjects.CONTROL, 1, JobSubmitted(job_id="j-000001", spec=JobSpec(name="j"), occurred_at=t0)))
    tl.show(stored(subjects.CONTROL, 2, RankLost(job_id="j-000001", rank=1, attempt=0, reason="exited with code 3",
                                                 last_seen=t0, occurred_at=t0 + 2.5)))
    tl.flush()
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["0.0s", "2.0s", "2.5s", "3.0s"]
