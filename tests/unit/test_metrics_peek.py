"""What the demo prints of `curl /metrics`: only the chosen figures of its own job, a phase only where it holds,
and "settled" only once the server has folded both the job's end and postmortem's analysis of it."""

from pathlib import Path

from flightdeck.services.tools.console.metrics_peek import job_lines, settled
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.web.figures import Figures, IncidentRow, JobAnalysis
from flightdeck.services.tools.web.metrics import Live, exposition

ROOT = Path(__file__).resolve().parents[2]
JOB = "crash-000001"


def figures() -> Figures:
    f = Figures()
    for stored in fdh.load(ROOT / "tests" / "fixtures" / "histories" / "crash.fdh.jsonl"):
        f.fold(stored)
    return f


def test_only_this_jobs_chosen_figures_and_its_one_phase() -> None:
    f = figures()
    before = job_lines(exposition(f, Live(broker_up=True), now=f.jobs[JOB].view.ended_at).decode(), JOB)
    assert before == [f'flightdeck_job_phase{{job_id="{JOB}",phase="completed"}} 1',
                      f'flightdeck_job_step{{job_id="{JOB}"}} 40',
                      f'flightdeck_job_restarts_total{{job_id="{JOB}"}} 1',
                      f'flightdeck_job_rollbacks_total{{job_id="{JOB}"}} 0']
    assert not settled(before)  # ended, but postmortem's analysis is not folded yet
    assert job_lines(exposition(f, Live(broker_up=True), now=f.jobs[JOB].view.ended_at).decode(), "another-job") == []

    row = IncidentRow(number=1, kind="crash", trigger="rank 1 exited", attempt=0, fault_s=3.0, detect_s=0.5,
                      recover_s=2.0, decision="restart", resolution="resumed", steps_redone=3)
    # An analysis taken before the end (here of its first events only) lacks its last commits: not shown yet.
    job = f.jobs[JOB]
    job.analysis = JobAnalysis(goodput=0.5, parts={}, control_seq=1, telemetry_seq=1, rows=(), commits=(0.25,))
    assert job_lines(exposition(f, Live(broker_up=True), now=f.jobs[JOB].view.ended_at).decode(), JOB) == before
    job.analysis = JobAnalysis(goodput=0.75, parts={}, control_seq=job.control_seq, telemetry_seq=job.telemetry_seq,
                               rows=(row,), commits=(0.25, 0.5))
    after = job_lines(exposition(f, Live(broker_up=True), now=f.jobs[JOB].view.ended_at).decode(), JOB)
    assert after[4:] == [f'flightdeck_job_goodput_ratio{{job_id="{JOB}"}} 0.75',
                         f'flightdeck_checkpoint_commit_seconds_count{{job_id="{JOB}"}} 2',
                         f'flightdeck_job_incidents_total{{job_id="{JOB}",kind="crash"}} 1']
    assert settled(after)
    # The demo passes the commits it read from the log: a completed job's final one may be committed after its end,
    # and the figures are settled only once the server has folded that one too.
    assert settled(after, commits=2)
    assert not settled(after, commits=3)
