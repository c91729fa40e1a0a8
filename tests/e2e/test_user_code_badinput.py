"""A user's script that cannot run, fails at import, reports the wrong thing, or never calls the trainer API:
each ends with a named outcome in the job's history (the command, or the script's last lines quoted), and
the services go on (the next job runs). Real broker, services and node agent, as in every drill."""

from pathlib import Path

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.findings import RankLost
from flightdeck.events.job import JobCompleted, JobFailed, JobResumed, WorkersExited
from flightdeck.events.spec import EntrypointSpec, JobSpec, ModelSpec, TrainSpec
from flightdeck.events.training import RankFault
from flightdeck.services.agent.spawner import START_FAILED_EXIT
from tests.e2e.drill_harness import DRILL_POLICY
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def user_job(name: str, command: list[str], *, restarts: int = 1, **policy: float) -> JobSpec:
    return JobSpec(name=name, slots=1, train=TrainSpec(steps=20, checkpoint_every=5),
                   entrypoint=EntrypointSpec(command=command),
                   policy=msgspec.structs.replace(DRILL_POLICY, max_restarts=restarts, **policy))


async def ended(p: Platform, job: str) -> JobFailed | JobCompleted:
    await p.until(lambda: bool(p.seen(JobFailed, job) or p.seen(JobCompleted, job)), 180, "the job to end", job)
    return (p.seen(JobFailed, job) or p.seen(JobCompleted, job))[0]


async def script_job(p: Platform, tmp_path: Path, name: str, source: str, *agent: str,
                     **policy: float) -> tuple[str, JobFailed | JobCompleted]:
    """A job of one rank running `source` as its script, on a fresh one-slot agent, with 3 restarts; its end."""
    script = tmp_path / "train.py"
    script.write_text(source)
    p.agent("n1", "--slots", "1", *agent)
    await p.ready("n1")
    job = f"{name}-000001"
    await p.submit(user_job(name, ["python", str(script)], restarts=3, **policy), job)
    return job, await ended(p, job)


async def test_a_command_that_is_not_there_fails_the_job_once_naming_it(drill: Platform, tmp_path: Path) -> None:
    p = drill
    p.agent("n1", "--slots", "1")
    await p.ready("n1")
    await p.submit(user_job("nofile", ["python", str(tmp_path / "missing.py")], restarts=3), "nofile-000001")
    await p.submit(user_job("noprog", ["no-such-program-xyz", "--flag"], restarts=3), "noprog-000001")
    for job, said in (("nofile-000001", f"the script '{tmp_path / 'missing.py'}' does not exist"),
                      ("noprog-000001", "'no-such-program-xyz' is not an executable file")):
        failed = await ended(p, job)
        assert isinstance(failed, JobFailed), kinds(p.job(job))
        assert said in failed.reason and "not restarted: the job's command cannot run" in failed.reason
        (exit_,) = p.seen(WorkersExited, job)
        assert exit_.unrunnable and exit_.exit_code == START_FAILED_EXIT and said in exit_.cause
        assert not p.seen(JobResumed, job)  # no restart budget spent on a command that cannot run

    # the services are unaffected: the built-in trainer's next job runs to completion
    await p.submit(JobSpec(name="after", slots=1, model=ModelSpec(d_model=32),
                           train=TrainSpec(steps=5, checkpoint_every=5, data="synthetic")), "after-000001")
    assert isinstance(await ended(p, "after-000001"), JobCompleted)


async def test_a_script_that_fails_at_import_is_retried_then_failed_quoting_its_traceback(
        drill: Platform, tmp_path: Path) -> None:
    p = drill
    job, failed = await script_job(p, tmp_path, "imports",
                                   "import flightdeck\nimport no_such_module_for_flightdeck_tests\n")
    assert isinstance(failed, JobFailed)
    said = "ModuleNotFoundError: No module named 'no_such_module_for_flightdeck_tests'"
    # One restart (the first failure may be the node's), not the whole budget: the same error before the first
    # step again cannot be fixed by another (policy.fail_fast).
    assert failed.reason == (f"rank 0 exited with code 1: {said}; not restarted: attempt 0 failed the same way "
                             "before its first step, so a restart cannot fix it"), failed.reason
    exits = p.seen(WorkersExited, job)
    assert [(e.exit_code, e.error, e.early, e.unlinked) for e in exits] == [(1, said, True, True)] * 2
    assert all("Traceback" in e.cause for e in exits)


async def test_a_script_reporting_a_wrong_type_fails_with_a_named_rank_fault(drill: Platform, tmp_path: Path) -> None:
    p = drill
    job, failed = await script_job(p, tmp_path, "wrongtype", "import flightdeck\nrun = flightdeck.init()\n"
                                   "for step in run.steps():\n    run.report(step, loss='low')\n")
    assert isinstance(failed, JobFailed)
    said = "TypeError: report(loss=...) takes a number or a one-element tensor, got str"
    assert failed.reason == (f"rank 0 exited with code 1: {said}; not restarted: the trainer API refused the "
                             "script's call, and a restart runs the same code"), failed.reason
    (exit_,) = p.seen(WorkersExited, job)  # no restart spent
    assert (exit_.error, exit_.usage, exit_.early, exit_.unlinked) == (said, True, True, False)
    await p.until(lambda: bool(p.seen(RankFault, job, stream=subjects.TELEMETRY)), 30, "the rank fault", job)
    (fault,) = p.seen(RankFault, job, stream=subjects.TELEMETRY)
    assert (fault.kind, fault.error_type, fault.step, fault.usage) == ("exception", "TypeError", 0, True)


async def test_a_script_that_never_calls_the_api_is_found_silent_like_a_lost_rank(
        drill: Platform, tmp_path: Path) -> None:
    p = drill
    # The grace covers the agent's start of the rank too: 4 s was too little for it on a loaded CI box.
    job, failed = await script_job(p, tmp_path, "silent", "import time\nprint('training without telling anyone', "
                                   "flush=True)\ntime.sleep(600)\n", "--grace-s", "1", startup_grace_s=12.0)
    assert isinstance(failed, JobFailed)
    lost = p.seen(RankLost, job)
    assert [(x.rank, x.attempt, x.never_heard) for x in lost] == [(0, 0, True), (0, 1, True)]
    assert "it never called flightdeck.init()" in lost[0].reason
    assert failed.reason.startswith("rank 0 lost: no heartbeat within") and failed.reason.endswith(
        "it never called flightdeck.init(), or was stuck before it; not restarted: attempt 0 failed the same way "
        "before its first step, so a restart cannot fix it"), failed.reason


async def test_a_script_that_exits_0_without_calling_the_api_is_no_completion(
        drill: Platform, tmp_path: Path) -> None:
    """Exit 0 means every step ran; a script that never called flightdeck.init() ran none that anyone saw."""
    p = drill
    job, failed = await script_job(p, tmp_path, "noinit", "print('trained, says the script', flush=True)\n")
    assert isinstance(failed, JobFailed), kinds(p.job(job))
    assert failed.reason == ("rank 0 exited with code 0 without calling flightdeck.init(): trained, says the "
                             "script; not restarted: attempt 0 failed the same way before its first step, so a "
                             "restart cannot fix it"), failed.reason
    assert [(e.exit_code, e.unlinked, e.early) for e in p.seen(WorkersExited, job)] == [(0, True, True)] * 2
