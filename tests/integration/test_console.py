"""`flightdeck up --detach`, `events` and `down` as a user runs them: real processes, a real broker.

One `up` serves the whole module (starting five services is the slow part); the tests run in file
order and the last one takes it down.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import nats
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointFailed
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobCompleted, JobPhaseChanged, JobQueued, JobSubmitted
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.events.training import StepCompleted
from flightdeck.services import registry
from flightdeck.services.shell import broker
from flightdeck.services.tools.console import up as up_mod
from flightdeck.services.tools.console import upstate

pytestmark = pytest.mark.timeout(240)  # a hang guard: `up` starts five services and a broker
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")
REPO = Path(__file__).resolve().parents[2]
CONTRACT = REPO / "docs" / "contract"


@dataclass
class Up:
    data_dir: Path
    port: int
    url: str
    stdout: str
    ui: str = ""  # where its web server serves /metrics


def flightdeck(*args: str, timeout: float = 120.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    data_dir = tmp_path_factory.mktemp("fd") / "data"
    port, ui_port = broker.free_port(), broker.free_port()
    done = flightdeck("up", "--detach", "--data-dir", str(data_dir), "--port", str(port), "--ui-port", str(ui_port),
                      timeout=180)
    assert done.returncode == 0, done.stderr + done.stdout
    yield Up(data_dir, port, f"nats://127.0.0.1:{port}", done.stdout, f"http://127.0.0.1:{ui_port}")
    flightdeck("down", "--data-dir", str(data_dir))  # a no-op when the last test already did it


def state(up: Up) -> upstate.UpState:
    found = upstate.read_state(up.data_dir)
    assert found is not None
    return found


async def seed_job(url: str, job_id: str) -> None:
    store = await JetStreamStore.connect(url)
    t0 = 1_700_000_000.0
    try:
        await append_to_job(store, JobSubmitted(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=t0,
                                                producer="cli", spec=JobSpec(name="demo")))
        await append_to_job(store, JobQueued(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=t0 + 0.5,
                                             priority=50, reason="seeded"))
        await store.append(subjects.telemetry(job_id, 0, "StepCompleted"), StepCompleted(
            event_id=uuid.uuid4().hex, job_id=job_id, rank=0, occurred_at=t0 + 1.0, step=1, loss=float("nan"),
            grad_norm=1.0, lr=0.003, tokens_per_s=1000.0, step_time_s=0.1))
    finally:
        await store.close()


def test_up_detach_starts_the_broker_and_every_service(up: Up) -> None:
    s = state(up)
    assert s.status == "ready" and s.url == up.url and s.port == up.port
    assert sorted(s.processes) == sorted([*registry.names(), *(name for name, _ in up_mod.OTHER_PROCESSES), "ui"])
    assert all(pid is not None and upstate.alive(pid) for pid in s.processes.values())
    assert s.broker_pid is not None and upstate.alive(s.broker_pid) and upstate.alive(s.pid)
    assert f"flightdeck is up: broker {up.url}" in up.stdout
    assert f"dashboard {up.ui}/ ; metrics (Prometheus) at {up.ui}/metrics" in up.stdout
    for name in s.processes:
        assert (up.data_dir / "logs" / f"{name}.log").exists()
    # no --secrets: it says plainly that it trusts every client (trial 8, 86ea31b: forged events were acted on)
    assert f"the broker trusts every client that reaches {up.url}" in (up.data_dir / "logs" / "up.log").read_text()


def test_a_second_up_refuses_the_same_data_dir_or_a_taken_port(up: Up, tmp_path: Path) -> None:
    again = flightdeck("up", "--data-dir", str(up.data_dir), "--port", str(broker.free_port()))
    assert again.returncode == 1
    assert "already running" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    taken = flightdeck("up", "--detach", "--data-dir", str(tmp_path / "other"), "--port", str(up.port))
    assert taken.returncode == 1
    assert f"port {up.port} is taken" in taken.stderr and "Traceback" not in taken.stderr


def test_events_prints_a_job_history_in_order(up: Up) -> None:
    # The running scheduler answers JobSubmitted with events of its own, so the history holds ours in
    # order with (perhaps) its between them.
    asyncio.run(seed_job(up.url, "demo-aaa111"))
    human = flightdeck("events", "demo-aaa111", "--nats", up.url)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    # its first line is the job's first event (the stream sequence depends on what the node agent recorded first)
    assert lines[0].split()[1:3] == ["+0.000s", "JobSubmitted"]
    ours = [line for line in lines if "reason=seeded" in line]
    assert len(ours) == 1 and ours[0].split()[1:3] == ["+0.500s", "JobQueued"]
    assert "priority=50 reason=seeded" in ours[0]

    as_json = flightdeck("events", "demo-aaa111", "--json", "--telemetry", env={"FLIGHTDECK_NATS_URL": up.url})
    assert as_json.returncode == 0, as_json.stderr
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert all({"seq", "type", "occurred_at", "job_id", "stream", "subject"} <= r.keys() for r in rows)
    control = [r for r in rows if r["stream"] == "FD_CONTROL" and ".node." not in r["subject"]]  # node records: 0
    assert [r["job_version"] for r in control] == list(range(1, len(control) + 1))
    assert all(r["job_version"] == 0 for r in rows if r["stream"] == "FD_CONTROL" and ".node." in r["subject"])
    assert control[0]["type"] == "JobSubmitted" and control[0]["spec"]["name"] == "demo"
    # ours (the running services may have started real ranks for the seeded job by now: their steps have losses)
    (step,) = [r for r in rows if r["stream"] == "FD_TELEMETRY" and r.get("loss") == "nan"]
    assert step["type"] == "StepCompleted" and step["loss"] == "nan" and step["job_version"] == 0

    every = flightdeck("events", "--all", "--nats", up.url)
    assert "JobSubmitted           job_id=demo-aaa111" in every.stdout


def test_unknown_job_and_unreachable_broker_are_one_line_errors(up: Up) -> None:
    unknown = flightdeck("events", "no-such-job", "--nats", up.url)
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        f"flightdeck events: no job 'no-such-job' on {up.url}: check the id (`flightdeck events --all` lists "
        "every job's events)"]
    nowhere = flightdeck("events", "x", "--nats", f"nats://127.0.0.1:{broker.free_port()}")
    assert nowhere.returncode == 1
    assert len(nowhere.stderr.strip().splitlines()) == 1 and "cannot reach the broker" in nowhere.stderr


async def append_completed(url: str, job_id: str) -> None:
    """The job's end as the scheduler records it: its JobCompleted, then the phase that says so."""
    store = await JetStreamStore.connect(url)
    try:
        await append_to_job(store, JobCompleted(event_id=uuid.uuid4().hex, job_id=job_id,
                                                occurred_at=1_700_000_003.0, steps=1))
        await append_to_job(store, JobPhaseChanged(event_id=uuid.uuid4().hex, job_id=job_id, phase="completed",
                                                   attempt=0, restarts=0, occurred_at=1_700_000_003.0))
    finally:
        await store.close()


async def append_final_failed(url: str, job_id: str) -> None:
    store = await JetStreamStore.connect(url)
    try:
        await append_to_job(store, CheckpointFailed(event_id=uuid.uuid4().hex, job_id=job_id, step=100,
                                                    occurred_at=1_700_000_004.0, reason="disk full"))
    finally:
        await store.close()


async def seed_unplaced(url: str, job_id: str) -> None:
    """A job more slots than the fleet has: the live platform queues it and never runs it, so only this test's own
    appends end it."""
    store = await JetStreamStore.connect(url)
    try:
        spec = JobSpec(name="demo", slots=64, train=TrainSpec(batch_size=64))
        await append_to_job(store, JobSubmitted(event_id=uuid.uuid4().hex, job_id=job_id, occurred_at=1_700_000_000.0,
                                                producer="cli", spec=spec))
    finally:
        await store.close()


def test_events_follow_prints_new_events_until_the_job_has_ended_with_its_final_checkpoint(up: Up) -> None:
    asyncio.run(seed_unplaced(up.url, "demo-bbb222"))
    proc = subprocess.Popen([*CLI, "events", "demo-bbb222", "--follow", "--nats", up.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "JobSubmitted" in proc.stdout.readline()
        asyncio.run(append_completed(up.url, "demo-bbb222"))
        # The module's timeout guards a follow that never prints.
        line = next(line for line in proc.stdout if "JobCompleted" in line)
        assert "+3.000s" in line and "steps=1" in line
        # its final checkpoint (steps 100, every 25) is still to come: the follow goes on for it ...
        assert proc.poll() is None
        asyncio.run(append_final_failed(up.url, "demo-bbb222"))
        # ... and stops by itself once it failed, having printed it
        rest = proc.stdout.read()
        assert proc.wait(30) == 0 and "CheckpointFailed" in rest, rest
    finally:
        proc.kill()
        proc.wait()


async def raw_submit_and_follow(url: str, job_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a client in another language does, from docs/contract alone: no `events` code, only nats-py, a generic
    msgpack codec and the documents (the subjects from the AsyncAPI channels, the fields from the JSON Schema, the
    append headers from the AsyncAPI description). Returns the job's control history and its ranks' steps."""
    schema = json.loads((CONTRACT / "events.schema.json").read_text())
    doc = json.loads((CONTRACT / "asyncapi.json").read_text())
    channels = doc["channels"]

    def valid(message: dict[str, Any]) -> dict[str, Any]:
        jsonschema.validate(message, {"$ref": f"#/$defs/{message['type']}", "$defs": schema["$defs"]})
        return message

    submitted = valid({"type": "JobSubmitted", "event_id": uuid.uuid4().hex, "occurred_at": time.time(),
                       "producer": "raw-client", "job_id": job_id, "job_version": 1,
                       "spec": {"name": "raw", "slots": 1, "model": {"d_model": 32},
                                "train": {"steps": 6, "checkpoint_every": 3, "data": "synthetic", "seed": 1}}})
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        job_prefix = channels["job.JobSubmitted"]["address"].replace("{job_id}", job_id).rsplit(".", 1)[0]
        everything, fence = job_prefix + ".>", job_prefix + ".*"
        await js.publish(channels["job.JobSubmitted"]["address"].replace("{job_id}", job_id),
                         msgspec.msgpack.encode(submitted),
                         headers={"Nats-Msg-Id": submitted["event_id"], "Nats-Expected-Last-Subject-Sequence": "0",
                                  "Nats-Expected-Last-Subject-Sequence-Subject": fence})
        steps_at = channels["telemetry.StepCompleted"]["address"].replace("{job_id}", job_id).replace("{rank}", "*")
        steps = await js.subscribe(steps_at, ordered_consumer=True)
        control = await js.subscribe(everything, ordered_consumer=True)
        history: list[dict[str, Any]] = []
        # Until the job's end and, as it completes, its final checkpoint (step 6 of 6, every 3): the checkpoint
        # service commits it at its next tick, which may come just after JobCompleted (docs/internals.md, 5).
        while not history or history[-1]["type"] not in ("JobCompleted", "JobFailed", "JobCancelled"):
            history.append(valid(msgspec.msgpack.decode((await control.next_msg(timeout=200)).data)))
        if history[-1]["type"] == "JobCompleted":
            while not any(m["type"] == "CheckpointCommitted" and m["step"] == 6 for m in history):
                history.append(valid(msgspec.msgpack.decode((await control.next_msg(timeout=200)).data)))
        seen = []
        while len(seen) < 6:
            seen.append(valid(msgspec.msgpack.decode((await steps.next_msg(timeout=30)).data)))
        return history, seen
    finally:
        await nc.close()


def test_readme_s_client_snippet_is_the_quickstart_example_and_it_runs(up: Up, tmp_path: Path) -> None:
    quickstart = REPO / "examples" / "client_quickstart.py"
    code = quickstart.read_text()
    snippet = code[code.index("from flightdeck.client"):code.index("\n\n\nif __name__")] + "\n"
    assert f"```python\n{snippet}```" in (REPO / "README.md").read_text()  # README shows what runs here
    spec = tmp_path / "tiny.toml"
    spec.write_text('name = "quick"\nslots = 1\n[model]\nd_model = 32\n'
                    '[train]\nsteps = 4\ncheckpoint_every = 2\ndata = "synthetic"\n')
    env = {**os.environ, "FLIGHTDECK_NATS_URL": up.url}
    done = subprocess.run([sys.executable, str(quickstart), str(spec)], capture_output=True, text=True, timeout=180,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "JobSubmitted" and "JobCompleted" in lines, lines
    job = lines[-2].split()[0]
    assert lines[-2].startswith(f"{job} completed 4 0 "), lines
    assert lines[-1] == f"{job} is completed: only a running job's ranks take commands; nothing sent", lines
    # the failure pager, resumable from a stream position: nothing failed, so it waits (and is stopped here)
    paging = (f"import asyncio, runpy; ns = runpy.run_path({str(quickstart)!r})\n"
              "try:\n    asyncio.run(asyncio.wait_for(ns['page_on_failures'](0), 3))\n"
              "except TimeoutError:\n    print('waited')\n")
    waited = subprocess.run([sys.executable, "-c", paging], capture_output=True, text=True, timeout=60, env=env)
    assert waited.stdout.splitlines()[-1:] == ["waited"], waited.stdout + waited.stderr


def test_a_raw_nats_client_submits_and_follows_a_job_by_the_published_contract(up: Up) -> None:
    history, steps = asyncio.run(raw_submit_and_follow(up.url, "raw-c0ffee"))
    types = [m["type"] for m in history]
    assert types[0] == "JobSubmitted" and history[0]["producer"] == "raw-client"
    end = types.index("JobCompleted")
    assert history[end]["steps"] == 6, types
    # the final checkpoint committed, before the end or after it; after the end only its slots given back, the
    # scheduler's record of its phase, and its checkpoints' records (a CI run read on past the phase to a late commit)
    assert [m["step"] for m in history if m["type"] == "CheckpointCommitted"][-1] == 6, types
    after = [m for m in history[end + 1:] if not m["type"].startswith("Checkpoint")]
    assert all(m["type"] == "AllocationReleased" or (m["type"], m.get("phase")) == ("JobPhaseChanged", "completed")
               for m in after), types[end:]
    # node agents' records stand under their node (the channel says so) and are not numbered; the rest run 1, 2, ...
    node_records = {name for ch in json.loads((CONTRACT / "asyncapi.json").read_text())["channels"].values()
                    if ch["address"].startswith("fd.ctl.job.") and ".node.{node}." in ch["address"]
                    for name in ch["messages"]}
    assert node_records == {"WorkersStarted", "WorkersExited"}
    numbered = [m["job_version"] for m in history if m["type"] not in node_records]
    assert numbered == list(range(1, len(numbered) + 1))
    assert all(m["job_version"] == 0 for m in history if m["type"] in node_records)
    assert {"JobQueued", "AllocationGranted", "WorkersStarted", "CheckpointCommitted"} <= set(types)
    assert [m["step"] for m in steps] == list(range(6)) and all(m["job_id"] == "raw-c0ffee" for m in steps)
    shown = flightdeck("status", "raw-c0ffee", "--nats", up.url)  # and the platform's own tools agree
    assert shown.returncode == 0 and "completed" in shown.stdout, shown.stdout + shown.stderr
    # up's web server: the job's figures on /metrics, as a Prometheus scrape reads them
    wanted = {('flightdeck_job_phase{job_id="raw-c0ffee",phase="completed"}', 1.0),
              ('flightdeck_job_steps_total{job_id="raw-c0ffee"}', 6.0),
              ('flightdeck_job_steps_planned{job_id="raw-c0ffee"}', 6.0)}
    wait_for(lambda: wanted <= scraped(up.ui), timeout=60)


def scraped(ui: str) -> set[tuple[str, float]]:
    with urllib.request.urlopen(ui + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_a_killed_service_is_restarted(up: Up) -> None:
    before = state(up).processes["scheduler"]
    assert before is not None
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: state(up).processes["scheduler"] not in (None, before))
    after = state(up).processes["scheduler"]
    assert after is not None and upstate.alive(after) and not upstate.alive(before)
    log = (up.data_dir / "logs" / "scheduler.log").read_text()
    assert "scheduler exited with code -9; restarting in 0.5s" in log


def test_a_killed_broker_is_restarted_on_the_same_port_and_store(up: Up) -> None:
    before = state(up).broker_pid
    assert before is not None
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: state(up).broker_pid not in (None, before))
    asyncio.run(seed_job(up.url, "demo-ccc333"))  # it answers, and kept what it had stored
    shown = flightdeck("events", "demo-aaa111", "--nats", up.url)
    assert shown.returncode == 0 and "JobQueued" in shown.stdout


def test_down_stops_every_process(up: Up) -> None:
    s = state(up)
    pids = [s.pid, s.broker_pid, *s.processes.values()]
    done = flightdeck("down", "--nats", up.url)  # found by its broker: no --data-dir needed
    assert done.returncode == 0, done.stderr
    assert f"flightdeck stopped: supervisor pid {s.pid}" in done.stdout
    assert [p for p in pids if p is not None and upstate.alive(p)] == []
    assert upstate.read_state(up.data_dir) is None
    again = flightdeck("down", "--data-dir", str(up.data_dir))
    assert again.returncode == 0 and "nothing to stop" in again.stdout


def test_down_for_a_broker_no_up_here_serves_says_what_to_pass(nats_server: broker.Broker) -> None:
    done = flightdeck("down", "--nats", nats_server.url)
    assert done.returncode == 2 and done.stdout == ""
    assert f"a broker answers at {nats_server.url}, but no flightdeck up on this machine serves it" in done.stderr
    assert "--data-dir" in done.stderr
    nowhere = flightdeck("down", env={"FLIGHTDECK_NATS_URL": f"nats://127.0.0.1:{broker.free_port()}"})
    assert nowhere.returncode == 0 and "nothing to stop" in nowhere.stdout


def start_foreground(data_dir: Path, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*CLI, "up", "--data-dir", str(data_dir), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: proc.poll() is not None or getattr(upstate.read_state(data_dir), "status", "") == "ready",
             timeout=180)
    assert proc.poll() is None, proc.communicate()[0]
    return proc


def our_pids(s: upstate.UpState) -> list[int]:
    return [p for p in (s.pid, s.broker_pid, *s.processes.values()) if p is not None]


def test_foreground_up_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    proc = start_foreground(tmp_path / "fg", broker.free_port())
    try:
        pids = our_pids(upstate.read_state(tmp_path / "fg"))  # type: ignore[arg-type]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "flightdeck: ready" in out and out.rstrip().endswith("flightdeck: stopped")
        assert [p for p in pids if upstate.alive(p)] == []
        assert upstate.read_state(tmp_path / "fg") is None
    finally:
        proc.kill()
        proc.wait()


def test_up_and_down_clean_up_after_a_killed_supervisor(tmp_path: Path) -> None:
    data_dir, port = tmp_path / "k", broker.free_port()
    proc = start_foreground(data_dir, port)
    try:
        killed_supervisor(data_dir, port, proc)
    finally:  # whatever failed, nothing of it is left running
        proc.kill()
        proc.wait()
        flightdeck("down", "--data-dir", str(data_dir))


def killed_supervisor(data_dir: Path, port: int, proc: subprocess.Popen[str]) -> None:
    first = state(Up(data_dir, port, "", ""))
    proc.kill()  # SIGKILL: no chance to stop anything; its services go with it (PR_SET_PDEATHSIG)
    proc.wait()
    assert first.broker_pid is not None and upstate.alive(first.broker_pid)
    again = flightdeck("up", "--detach", "--data-dir", str(data_dir), "--port", str(port), timeout=180)
    assert again.returncode == 0, again.stderr + again.stdout
    assert [p for p in our_pids(first) if upstate.alive(p)] == []
    second = state(Up(data_dir, port, "", ""))
    os.kill(second.pid, signal.SIGKILL)
    wait_for(lambda: not upstate.alive(second.pid))
    down = flightdeck("down", "--data-dir", str(data_dir))
    assert down.returncode == 0, down.stderr
    assert [p for p in our_pids(second) if upstate.alive(p)] == []
