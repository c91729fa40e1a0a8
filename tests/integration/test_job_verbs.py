"""`flightdeck submit / status / cancel / checkpoints` as a user runs them (the CLI in a subprocess), against a
real nats-server holding histories written with append_to_job. No services run: what a verb
shows comes only from the events these tests wrote."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import nats
import pytest

from flightdeck.events import subjects
from flightdeck.events.base import Event, JobEvent, RankEvent
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.history import append_to_job, read_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import (
    AllocationGranted,
    AllocationRequested,
    CancelRequested,
    JobCompleted,
    JobQueued,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.spec import parse_spec
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")


def flightdeck(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


async def write(url: str, events: Sequence[Event]) -> None:
    store = await JetStreamStore.connect(url)
    try:
        for ev in events:
            if isinstance(ev, RankEvent):  # what a rank publishes goes to telemetry
                await store.append(subjects.telemetry(ev.job_id, ev.rank, type(ev).__name__), ev)
            else:
                assert isinstance(ev, JobEvent)
                await append_to_job(store, ev)
    finally:
        await store.close()


async def history(url: str, job_id: str) -> list[Event]:
    store = await JetStreamStore.connect(url)
    try:
        return [s.event for s in await read_job(store, job_id) if s.event is not None]
    finally:
        await store.close()


async def control_count(url: str) -> int:
    store = await JetStreamStore.connect(url)
    try:
        return await store.last_seq(subjects.CONTROL)
    finally:
        await store.close()


def ids() -> str:
    return uuid.uuid4().hex


def running_job(job_id: str) -> list[Event]:
    """A 2-rank job submitted 125 s ago, placed, started, checkpointed twice (one deleted), at step 57."""
    t0 = time.time() - 125.0
    spec = parse_spec((ROOT / "examples" / "tiny-drill.toml").read_bytes())
    ckpt = {"job_id": job_id, "world_size": 2, "data": DataPosition(next_batch=1)}
    return [
        JobSubmitted(event_id=ids(), job_id=job_id, occurred_at=t0, producer="cli", spec=spec),
        JobQueued(event_id=ids(), job_id=job_id, occurred_at=t0 + 1, priority=50, reason="submitted"),
        AllocationRequested(event_id=ids(), job_id=job_id, occurred_at=t0 + 1, slots=2, attempt=0),
        AllocationGranted(event_id=ids(), job_id=job_id, occurred_at=t0 + 2, attempt=0,
                          assignments=[SlotRef(node="n0", slot=0, rank=0), SlotRef(node="n0", slot=1, rank=1)]),
        WorkersStarted(event_id=ids(), job_id=job_id, occurred_at=t0 + 3, node="n0", attempt=0, ranks=[0, 1],
                       pids=[11, 12]),
        CheckpointCommitted(event_id=ids(), occurred_at=t0 + 10, checkpoint_id="step000000020-a0", step=20,
                            uri=f"file:///o/checkpoints/{job_id}/step000000020-a0/MANIFEST.json", bytes=2048, **ckpt),
        CheckpointCommitted(event_id=ids(), occurred_at=t0 + 20, checkpoint_id="step000000040-a0", step=40,
                            uri=f"file:///o/checkpoints/{job_id}/step000000040-a0/MANIFEST.json",
                            bytes=3 * 1024 * 1024, **ckpt),
        CheckpointDeleted(event_id=ids(), job_id=job_id, occurred_at=t0 + 21, checkpoint_id="step000000020-a0"),
        StepCompleted(event_id=ids(), job_id=job_id, rank=0, occurred_at=t0 + 25, step=57, loss=2.5, grad_norm=1.0,
                      lr=0.003, tokens_per_s=1e4, step_time_s=0.05),
    ]


def test_submit_prints_the_job_id_and_stores_the_spec(nats_server: broker.Broker) -> None:
    spec_file = ROOT / "examples" / "drill.toml"
    done = flightdeck("submit", str(spec_file), "--nats", nats_server.url)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert re.fullmatch(r"tiny-drill-[0-9a-f]{6}", job_id) and done.stdout == job_id + "\n"
    (submitted,) = asyncio.run(history(nats_server.url, job_id))
    assert isinstance(submitted, JobSubmitted)
    assert submitted.spec == parse_spec(spec_file.read_bytes())
    assert (submitted.job_version, submitted.producer) == (1, "cli") and submitted.occurred_at > time.time() - 30
    again = flightdeck("submit", str(spec_file), "--nats", nats_server.url)
    assert again.returncode == 0 and again.stdout.strip() != job_id


@pytest.mark.parametrize(("toml", "named"), [
    ('name = "x"\n[train]\nsteps = 0\n', "$.train.steps"),
    ('name = "x"\nslots = 2\n[[faults]]\nkind = "crash"\nrank = 2\nstep = 1\n', "faults[0].rank"),
    ('name = "x"\n[model]\nn_layers = 2\n', "n_layers"),
    ('name = "Not A Name"\n', "$.name"),
])
def test_an_invalid_spec_is_refused_naming_the_field_and_nothing_is_appended(
        nats_server: broker.Broker, tmp_path: Path, toml: str, named: str) -> None:
    spec_file = tmp_path / "bad.toml"
    spec_file.write_text(toml)
    done = flightdeck("submit", str(spec_file), "--nats", nats_server.url)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"flightdeck submit: {spec_file}: ") and named in line
    assert asyncio.run(control_count(nats_server.url)) == 0


def test_a_missing_spec_file_and_an_unreachable_broker_are_one_line_errors(tmp_path: Path) -> None:
    missing = flightdeck("submit", str(tmp_path / "nope.toml"), "--nats", "nats://127.0.0.1:1")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    nowhere = flightdeck("submit", str(ROOT / "examples" / "drill.toml"), "--nats",
                         f"nats://127.0.0.1:{broker.free_port()}")
    assert nowhere.returncode == 1
    (line,) = nowhere.stderr.strip().splitlines()
    assert "cannot reach the broker" in line


def test_status_shows_every_job_as_a_table_and_one_in_detail(nats_server: broker.Broker) -> None:
    began = time.time()
    asyncio.run(write(nats_server.url, [*running_job("tiny-drill-aaaaaa"), JobSubmitted(
        event_id=ids(), job_id="other-bbbbbb", occurred_at=time.time() - 60, producer="cli",
        spec=parse_spec('name = "other"\npriority = 7\n'))]))
    table = flightdeck("status", "--nats", nats_server.url)
    waited = time.time() - began  # the job was 125 s old when written; the CLI saw it this much older at most
    assert table.returncode == 0, table.stderr
    head, first, second = table.stdout.splitlines()
    assert head.split() == ["JOB", "PHASE", "PRIO", "SLOTS", "STEPS", "CHECKPOINT", "RESTARTS", "AGE"]
    assert first.split()[:8] == ["tiny-drill-aaaaaa", "running", "50", "2/2", "58/160", "step", "40", "0"]
    age = re.fullmatch(r"2m(\d\d)s", first.split()[8])
    assert age and 5 <= int(age[1]) <= 5 + waited + 1, (first, waited)  # + 1: the shown age is rounded
    assert second.split()[:6] == ["other-bbbbbb", "submitted", "7", "-/1", "-/100", "-"]

    one = flightdeck("status", "tiny-drill-aaaaaa", "--nats", nats_server.url)
    assert one.returncode == 0, one.stderr
    assert "phase:       running\n" in one.stdout
    assert "step000000040-a0 at step 40" in one.stdout and "58/160 done (loss 2.5)" in one.stdout

    as_json = json.loads(flightdeck("status", "tiny-drill-aaaaaa", "--json", "--nats", nats_server.url).stdout)
    assert {k: as_json[k] for k in ("job_id", "phase", "step", "world_size", "slots", "restarts", "version")} == {
        "job_id": "tiny-drill-aaaaaa", "phase": "running", "step": 57, "world_size": 2, "slots": 2, "restarts": 0,
        "version": 7}  # its 8 control events; the WorkersStarted among them is a node record, not numbered
    assert as_json["last_checkpoint"]["checkpoint_id"] == "step000000040-a0" and 120 < as_json["age_s"] < 200
    assert as_json["steps_done"] == 58
    every = json.loads(flightdeck("status", "--json", "--nats", nats_server.url).stdout)
    assert [v["job_id"] for v in every] == ["tiny-drill-aaaaaa", "other-bbbbbb"]


async def publish_junk(url: str, subject: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(subject, b"\x00 not an event")
    finally:
        await nc.close()


def test_status_of_an_unknown_job_and_of_an_empty_store(nats_server: broker.Broker) -> None:
    empty = flightdeck("status", "--nats", nats_server.url)
    assert empty.returncode == 0 and empty.stdout.startswith("no jobs on ")
    asyncio.run(publish_junk(nats_server.url, "fd.ctl.job.junk-000001.JobQueued"))  # no job was submitted there
    junk = flightdeck("status", "--nats", nats_server.url)
    assert junk.returncode == 0 and junk.stdout.startswith("no jobs on "), junk.stdout
    assert "1 job subject(s) with no readable submission left out (junk-000001)" in junk.stderr
    unknown = flightdeck("status", "nope-123456", "--nats", nats_server.url)
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == (f"flightdeck status: no job 'nope-123456' on {nats_server.url}: "
                                      "`flightdeck status` lists every job")


def test_cancel_appends_cancel_requested_once_and_leaves_ended_jobs_alone(nats_server: broker.Broker) -> None:
    asyncio.run(write(nats_server.url, running_job("tiny-drill-cccccc")))
    done = flightdeck("cancel", "tiny-drill-cccccc", "--reason", "wrong data", "--nats", nats_server.url)
    assert done.returncode == 0, done.stderr
    assert "cancel requested (phase running)" in done.stdout
    last = asyncio.run(history(nats_server.url, "tiny-drill-cccccc"))[-1]
    assert isinstance(last, CancelRequested) and (last.reason, last.job_version, last.producer) == (
        "wrong data", 8, "cli")  # after 8 control events, one of them an unnumbered node record
    twice = flightdeck("cancel", "tiny-drill-cccccc", "--nats", nats_server.url)
    assert twice.returncode == 0 and "already requested" in twice.stdout
    assert flightdeck("status", "tiny-drill-cccccc", "--nats", nats_server.url).stdout.count("stopping") == 1

    asyncio.run(write(nats_server.url, [JobCompleted(event_id=ids(), job_id="tiny-drill-cccccc", steps=160)]))
    before = asyncio.run(control_count(nats_server.url))
    ended = flightdeck("cancel", "tiny-drill-cccccc", "--nats", nats_server.url)
    assert ended.returncode == 0 and "has already ended (completed)" in ended.stdout
    assert asyncio.run(control_count(nats_server.url)) == before

    unknown = flightdeck("cancel", "ghost-000000", "--nats", nats_server.url)
    assert unknown.returncode == 2 and "no job 'ghost-000000'" in unknown.stderr


def test_checkpoints_lists_commits_with_the_deleted_marked(nats_server: broker.Broker) -> None:
    asyncio.run(write(nats_server.url, running_job("tiny-drill-dddddd")))
    done = flightdeck("checkpoints", "tiny-drill-dddddd", "--nats", nats_server.url)
    assert done.returncode == 0, done.stderr
    head, first, second = done.stdout.splitlines()
    assert head.split() == ["CHECKPOINT", "STEP", "WORLD", "SIZE", "VERIFIED", "(UTC)", "STATE", "URI"]
    day, clock = first.split()[5:7]  # verified when committed: no scrub has read it back since
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", day) and re.fullmatch(r"\d\d:\d\d:\d\d", clock), first
    assert first.split()[:5] + first.split()[7:] == [
        "step000000020-a0", "20", "2", "2.0", "KiB", "deleted", "(retention)",
        "file:///o/checkpoints/tiny-drill-dddddd/step000000020-a0/MANIFEST.json"]
    assert second.split()[:5] + second.split()[7:8] == ["step000000040-a0", "40", "2", "3.0", "MiB", "kept"]
    rows = json.loads(flightdeck("checkpoints", "tiny-drill-dddddd", "--json", "--nats", nats_server.url).stdout)
    assert [(r["step"], r["bytes"], r["deleted"]) for r in rows] == [(20, 2048, True), (40, 3 * 1024 * 1024, False)]
    asyncio.run(write(nats_server.url, running_job("tiny-drill-eeeeee")[:2]))
    none = flightdeck("checkpoints", "tiny-drill-eeeeee", "--nats", nats_server.url)
    assert none.returncode == 0 and "no committed checkpoint yet" in none.stdout
    assert flightdeck("checkpoints", "ghost-000000", "--nats", nats_server.url).returncode == 2


async def node_events(url: str, node: str) -> list[Event]:
    store = await JetStreamStore.connect(url)
    try:
        found: list[Event] = []
        async for batch in store.read(subjects.CONTROL, [f"fd.ctl.node.{node}.>"]):
            found.extend(s.event for s in batch if s.event is not None)
        return found
    finally:
        await store.close()


@pytest.mark.timeout(120)
def test_agent_joins_the_fleet_from_the_environment_up_gives_it_and_stops_on_sigterm(
        nats_server: broker.Broker, tmp_path: Path) -> None:
    env = {**os.environ, "FLIGHTDECK_DATA_DIR": str(tmp_path / "data"), "FLIGHTDECK_NATS_URL": nats_server.url}
    proc = subprocess.Popen([*CLI, "agent", "--node", "extra-1", "--slots", "1", "--device", "cpu"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (found := asyncio.run(node_events(nats_server.url, "extra-1"))) and proc.poll() is None:
            assert time.monotonic() < deadline, "the agent never registered"
            time.sleep(0.5)
        registered = found[0]
        assert isinstance(registered, NodeRegistered) and (registered.kind, registered.slots) == ("cpu", 1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert (tmp_path / "data").is_dir()  # its data dir came from $FLIGHTDECK_DATA_DIR, as under `up`
        assert '"event": "agent stopped"' in out  # not a terminal: JSON lines, like every service's log
    finally:
        proc.kill()
        proc.wait()
    bad = flightdeck("agent", "--slots", "0", "--nats", nats_server.url)
    assert bad.returncode == 2 and bad.stderr.strip() == "flightdeck agent: --slots must be at least 1"
