"""`flightdeck up --listen ADDR`: a broker other hosts can reach is never open. Without `--secrets` it refuses to
start; with it, every process runs as its own broker user, an anonymous connection is refused, and a job runs to
completion with ranks that hold no broker credential (no per-job step). Listens on 127.0.0.2 (loopback, but not the
default address)."""

import asyncio
import os
from pathlib import Path

import nats
import pytest

from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec, spec_toml
from flightdeck.services.shell import broker
from flightdeck.services.tools.console import upstate
from tests.integration.test_console import flightdeck, scraped, wait_for
from tests.security.secure_broker import CONNECT_TIMEOUT_S

pytestmark = pytest.mark.timeout(600)  # up (up to 180 s), a job (240 s), /metrics (180 s) on a loaded box
ADDR = "127.0.0.2"


def test_listening_beyond_loopback_without_credentials_is_refused(tmp_path: Path) -> None:
    done = flightdeck("up", "--listen", ADDR, "--data-dir", str(tmp_path / "d"), "--port", str(broker.free_port()))
    assert done.returncode != 0
    assert f"--listen {ADDR} puts the broker on the network: pass --secrets DIR too" in done.stderr, done.stderr
    assert upstate.read_state(tmp_path / "d") is None  # nothing was started


def test_a_secured_up_refuses_strangers_and_runs_a_job_whose_ranks_hold_no_credential(tmp_path: Path) -> None:
    data_dir, secrets, port, ui_port = tmp_path / "d", tmp_path / "secrets", broker.free_port(), broker.free_port()
    url = f"nats://{ADDR}:{port}"
    done = flightdeck("up", "--detach", "--listen", ADDR, "--secrets", str(secrets), "--data-dir", str(data_dir),
                      "--port", str(port), "--ui-port", str(ui_port), timeout=180)
    try:
        assert done.returncode == 0, done.stderr + done.stdout
        state = upstate.read_state(data_dir)
        assert state is not None and state.url == url and "gate" not in state.processes

        async def anonymous() -> None:
            nc = await nats.connect(url, allow_reconnect=False, connect_timeout=CONNECT_TIMEOUT_S)
            await nc.close()

        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            asyncio.run(anonymous())
        console = {"FLIGHTDECK_NATS_USER": "console",
                   "FLIGHTDECK_NATS_PASSWORD_FILE": str(secrets / "console.password")}
        spec = tmp_path / "gated.toml"
        spec.write_bytes(spec_toml(JobSpec(name="gated", slots=1, model=ModelSpec(d_model=32),
                                          train=TrainSpec(steps=20, checkpoint_every=10, data="synthetic"))))
        submitted = flightdeck("submit", str(spec), "--wait", "--nats", url, env=console, timeout=240)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert "JobCompleted: 20 steps" in submitted.stdout, submitted.stdout
        # The web server reads as `console`: the job's figures and the services' consumer lag are there.
        ui = f"http://127.0.0.1:{ui_port}"

        last: dict[str, float] = {}

        def served() -> bool:
            got = dict(scraped(ui))
            last.clear()
            last.update(got)
            done = [k for k, v in got.items() if v == 1.0 and k.startswith('flightdeck_job_phase{job_id="gated-')
                    and k.endswith('phase="completed"}')]
            lags = [f'flightdeck_service_consumer_lag_messages{{service="{n}"}}' for n in ("scheduler", "health")]
            return len(done) == 1 and got.get("flightdeck_broker_up") == 1.0 and all(k in got for k in lags)

        try:  # a few seconds when idle; CI's loaded box once took over 60 s, so the bound is generous
            wait_for(served, timeout=180)
        except AssertionError:
            shown = {k: v for k, v in last.items() if k.startswith(("flightdeck_job_phase", "flightdeck_broker_up",
                                                                    "flightdeck_service_consumer_lag_messages"))}
            logs = data_dir / "logs"
            ui_lines = (logs / "ui.log").read_text().splitlines()
            told = [line for line in ui_lines if "replay consumer start failed" not in line]  # once per 2 s each
            broker_log = (logs / "nats-server.log").read_text()[-3000:]
            pytest.fail(f"/metrics never showed the completed job, the broker up and two lags: {shown}\n"
                        f"ui.log less its {len(ui_lines) - len(told)} retry lines:\n" + "\n".join(told[-60:]) +
                        f"\nnats-server.log:\n{broker_log}")
        refused = flightdeck("status", "--nats", url, env={"FLIGHTDECK_NATS_USER": "console",
                                                          "FLIGHTDECK_NATS_PASSWORD_FILE": os.devnull})
        assert refused.returncode != 0  # a wrong (empty) password: the CLI is refused too
    finally:
        flightdeck("down", "--data-dir", str(data_dir))
