"""`flightdeck submit --wait` against a real platform: the job id first, then its progress and incidents as plain
lines (stdout is a pipe here), and exit 0 once it completed; `watch` of the ended job tells the same story, in time
order, at once."""

import asyncio
import subprocess
from pathlib import Path

import pytest

from flightdeck.services.shell import broker as broker_mod
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform
from tests.integration.test_postmortem_cli import CLI

__all__ = ["local_objects"]  # fixture

SPEC = """
name = "watched"
slots = 2
[model]
d_model = 32
[train]
steps = 40
checkpoint_every = 10
data = "synthetic"
[[faults]]
kind = "crash"
rank = 1
step = 25
"""


@pytest.mark.timeout(240)
async def test_submit_wait_follows_the_job_through_a_crash_to_its_end(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    spec = tmp_path / "watched.toml"
    spec.write_text(SPEC)
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        p.start_all()
        await p.ready("n1")
        run = await asyncio.to_thread(subprocess.run, [*CLI, "submit", str(spec), "--wait", "--nats", p.url],
                                      capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, run.stdout + run.stderr
        job, *lines = run.stdout.splitlines()
        assert job.startswith("watched-")
        notes = [line.split(None, 1)[1] for line in lines if not line.startswith(job)]
        progress = [line for line in lines if line.startswith(job)]
        order = ["FaultInjected: drill fault 'crash' injected at step 25 on rank 1",
                 "WorkersExited: rank 1 (attempt 0) on n1 exited with code 3", "recovering: rank 1 exited with code 3",
                 "JobResumed: attempt 1 on 2 ranks from step", "JobCompleted: 40 steps"]
        it = iter(notes)
        assert all(any(n.startswith(o) for n in it) for o in order), notes
        assert any(line.endswith("step 40/40, loss " + line.rsplit("loss ", 1)[-1]) for line in progress), progress
        assert any("running: step" in line for line in progress), progress

        # `watch` on the ended job tells it at once, its incidents in the order they happened (control and
        # telemetry merged by time: a drill fault, from telemetry, once came after the restart it caused)
        again = await asyncio.to_thread(subprocess.run, [*CLI, "watch", job, "--nats", p.url], capture_output=True,
                                        text=True, timeout=120)
        assert again.returncode == 0, again.stdout + again.stderr
        told = [line for line in again.stdout.splitlines() if not line.startswith(job)]
        times = [float(line.split()[0].rstrip("s")) for line in told]
        assert times == sorted(times), told
        it = iter(line.split(None, 1)[1] for line in told)
        assert all(any(n.startswith(o) for n in it) for o in order), told
    finally:
        await p.close()
