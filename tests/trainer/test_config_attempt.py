"""What a rank is told: the node agent's variables, the flags of `python -m flightdeck.trainer` over them, and the
attempt: $FLIGHTDECK_ATTEMPT when the agent sets it, else torchrun's restart count (a plain torchrun restart
re-runs the same command line, so drill faults of attempt 0 must not fire again)."""

from pathlib import Path

import pytest

from flightdeck.events import nodelocal as nl
from flightdeck.events.ranklink import LINK_ENV
from flightdeck.trainer.config import LOCAL_JOB, flags_to_env, from_env

SPEC = 'name = "t"\n[train]\ndata = "synthetic"\n'


def config_of(tmp_path: Path, extra: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    flags_to_env(["--job-id", "t-1", "--spec", str(spec), "--device", "cpu", *extra], env)
    return from_env(env)


def test_the_flag_wins_then_torchruns_restart_count_then_zero(tmp_path: Path) -> None:
    assert config_of(tmp_path, ["--attempt", "2"], {"TORCHELASTIC_RESTART_COUNT": "5"}).attempt == 2
    assert config_of(tmp_path, [], {"TORCHELASTIC_RESTART_COUNT": "1"}).attempt == 1
    assert config_of(tmp_path, [], {}).attempt == 0


def test_without_a_job_id_a_script_runs_alone_with_telemetry_off() -> None:
    cfg = from_env({LINK_ENV: "@agent", "WORLD_SIZE": "2", "RANK": "1", nl.DEVICE_ENV: "cpu"})
    assert (cfg.job_id, cfg.platform, cfg.agent, cfg.rank, cfg.world_size) == (LOCAL_JOB, False, None, 1, 2)
    assert cfg.spec.slots == 2 and cfg.plan is None and not cfg.resume_local
    restarted = from_env({"TORCHELASTIC_RESTART_COUNT": "1", nl.DEVICE_ENV: "cpu"})
    assert restarted.resume_local and restarted.attempt == 1  # a torchrun restart resumes from local staging


def test_the_agents_variables_are_read_and_bad_ones_named(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    env = {nl.JOB_ENV: "j-1", nl.SPEC_ENV: str(spec), nl.ATTEMPT_ENV: "3", LINK_ENV: "@agent-n1",
           nl.DEVICE_ENV: "cpu", nl.PLAN_ENV: '{"world_size": 4, "dp": 2, "tp": 2}', nl.SYNC_EVERY_ENV: "5"}
    cfg = from_env(env)
    assert (cfg.job_id, cfg.attempt, cfg.agent, cfg.sync_every, cfg.platform) == ("j-1", 3, "@agent-n1", 5, True)
    assert cfg.plan is not None and (cfg.plan.dp, cfg.plan.tp) == (2, 2)
    with pytest.raises(ValueError, match=r"\$FLIGHTDECK_SYNC_EVERY must be an integer"):
        from_env({**env, nl.SYNC_EVERY_ENV: "often"})
    with pytest.raises(ValueError, match=r"\$FLIGHTDECK_PLAN is not a parallel plan"):
        from_env({**env, nl.PLAN_ENV: "{"})
