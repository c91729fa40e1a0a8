"""`flightdeck replay / export / import` against a real nats-server holding histories written as the services
write them (append_to_job, telemetry under fd.tel, a recorded ClockTick). No services run."""

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import structlog

from flightdeck.events import subjects
from flightdeck.events.base import Event, RankEvent
from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition
from flightdeck.events.clock import ClockTick
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import (
    AllocationGranted,
    AllocationRequested,
    JobCompleted,
    JobQueued,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.logs import RankOutput
from flightdeck.events.spec import parse_spec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker
from flightdeck.services.tools.console.__main__ import main
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.read import job_rows

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")


def ids() -> str:
    return uuid.uuid4().hex


def step(job_id: str, n: int, at: float) -> StepCompleted:
    return StepCompleted(event_id=ids(), job_id=job_id, rank=0, occurred_at=at, step=n, loss=3.0 - n / 100,
                         grad_norm=1.0, lr=1e-3, tokens_per_s=1e4, step_time_s=0.1)


def story(job_id: str, t0: float) -> list[Event | tuple[str, int]]:
    """A 2-rank job: submitted, placed, running, steps 0-9, a checkpoint at 5, completed. ("tick", n) marks a
    health ClockTick that has folded the job's telemetry up to its n-th message."""
    spec = parse_spec((ROOT / "examples" / "tiny-drill.toml").read_bytes())
    slots = [SlotRef(node="n0", slot=0, rank=0), SlotRef(node="n0", slot=1, rank=1)]
    return [
        JobSubmitted(event_id=ids(), job_id=job_id, occurred_at=t0, producer="cli", spec=spec),
        JobQueued(event_id=ids(), job_id=job_id, occurred_at=t0, priority=50, reason="submitted"),
        AllocationRequested(event_id=ids(), job_id=job_id, occurred_at=t0, slots=2, attempt=0),
        AllocationGranted(event_id=ids(), job_id=job_id, occurred_at=t0 + 1, attempt=0, assignments=slots),
        WorkersStarted(event_id=ids(), job_id=job_id, occurred_at=t0 + 2, node="n0", attempt=0, ranks=[0, 1],
                       pids=[1, 2]),
        *[step(job_id, n, t0 + 3 + n) for n in range(6)],
        ("tick", 6),
        CheckpointCommitted(event_id=ids(), job_id=job_id, occurred_at=t0 + 9, checkpoint_id="step000000005-a0",
                            step=5, world_size=2, uri="file:///o/m.json", bytes=10, data=DataPosition(next_batch=6)),
        *[step(job_id, n, t0 + 3 + n) for n in range(6, 10)],
        JobCompleted(event_id=ids(), job_id=job_id, occurred_at=t0 + 14, steps=10),
    ]


async def write(url: str, job_ids: list[str]) -> dict[str, dict[str, int]]:
    """Two jobs' stories interleaved; for each job, the control sequence of each event type (last one wins)."""
    store = await JetStreamStore.connect(url)
    seqs: dict[str, dict[str, int]] = {j: {} for j in job_ids}
    t0 = time.time() - 60.0
    stories = [story(j, t0) for j in job_ids]
    try:
        for items in zip(*stories, strict=True):
            for job_id, item in zip(job_ids, items, strict=True):
                if isinstance(item, tuple):
                    position = await store.last_seq(subjects.TELEMETRY)
                    tick = ClockTick(event_id=ids(), occurred_at=t0 + 8.5, service="health", now=t0 + 8.5,
                                     positions={subjects.TELEMETRY: position})
                    result = await store.append(subjects.clock("health"), tick)
                    seqs[job_id]["tick"] = result.seq
                elif isinstance(item, RankEvent):
                    await store.append(subjects.telemetry(item.job_id, item.rank, type(item).__name__), item)
                else:
                    assert isinstance(item, JobSubmitted | JobQueued | AllocationRequested | AllocationGranted
                                      | WorkersStarted | CheckpointCommitted | JobCompleted)
                    result = await append_to_job(store, item)
                    seqs[job_id][type(item).__name__] = result.seq
    finally:
        await store.close()
    return seqs


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what the test itself printed (store logs) is not the command's output
    try:
        code = main(list(args))
    finally:
        structlog.reset_defaults()  # main() points logs at this test's captured stderr, which pytest then closes
    out = capsys.readouterr()
    return code, out.out, out.err


def test_replay_until_a_sequence_on_the_live_broker(nats_server: broker.Broker, capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    seqs = asyncio.run(write(nats_server.url, ["a-000001", "b-000002"]))["a-000001"]
    common = ("--nats", nats_server.url, "--data-dir", str(tmp_path / "none"))

    code, out, err = cli(capsys, "replay", "a-000001", "--until", str(seqs["WorkersStarted"]), "--json", *common)
    assert code == 0, err
    at_start = json.loads(out)
    assert at_start["control_seq"] == seqs["WorkersStarted"] and at_start["state"]["phase"] == "running"
    assert at_start["state"]["step"] is None  # no tick has folded any telemetry yet
    assert [e["type"] for e in at_start["timeline"]][:3] == ["JobSubmitted", "Phase", "AllocationRequested"]

    code, out, err = cli(capsys, "replay", "a-000001", "--until", str(seqs["tick"]), "--json", *common)
    at_tick = json.loads(out)["state"]
    assert at_tick["step"] == 5 and at_tick["checkpoints"] == [] and at_tick["phase"] == "running"

    code, out, err = cli(capsys, "replay", "a-000001", "--json", *common)
    whole = json.loads(out)
    assert whole["state"]["phase"] == "completed" and whole["state"]["step"] == 9 and whole["at"] is None
    assert len(whole["state"]["checkpoints"]) == 1 and whole["source"] == f"broker {nats_server.url}"
    assert {e["type"] for e in whole["timeline"]} >= {"JobSubmitted", "CheckpointCommitted", "JobCompleted", "Phase"}

    code, out, err = cli(capsys, "replay", "a-000001", "--until", "4s", *common)  # people read this one
    assert code == 0 and "phase:" in out and "running" in out and "JobCompleted" not in out

    code, out, err = cli(capsys, "replay", "nobody-000009", *common)
    assert code == 2 and "no job 'nobody-000009'" in err
    code, out, err = cli(capsys, "replay", "a-000001", "--until", "soon", *common)
    assert code == 1 and "--until 'soon'" in err


def _key(rows: list[Stored]) -> list[tuple[str, int, str, str, bytes]]:
    return [(s.stream, s.seq, s.subject, s.msg_id, s.data) for s in rows]


async def live_rows(url: str, job_id: str, *, output: bool = False) -> list[Stored]:
    store = await JetStreamStore.connect(url)
    try:
        return await job_rows(store, job_id, output=output)
    finally:
        await store.close()


async def print_lines(url: str, job_ids: list[str]) -> None:
    """What the jobs' ranks printed, as their agents publish it (FD_LOGS)."""
    store = await JetStreamStore.connect(url)
    try:
        for job_id in job_ids:
            for rank in (0, 1):
                out = RankOutput(job_id=job_id, rank=rank, attempt=0, first_line=0, lines=[f"{job_id} rank {rank}"],
                                 event_id=ids())
                await store.append(subjects.logs(job_id, 0, rank), out)
    finally:
        await store.close()


def test_export_then_import_replays_the_same_without_the_broker(nats_server: broker.Broker, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(write(nats_server.url, ["a-000001", "b-000002"]))
    asyncio.run(print_lines(nats_server.url, ["a-000001", "b-000002"]))
    rows = asyncio.run(live_rows(nats_server.url, "a-000001", output=True))
    assert [s.event.lines for s in rows if s.stream == subjects.LOGS] == [["a-000001 rank 0"], ["a-000001 rank 1"]]
    telemetry_jobs = {subjects.job_of(s.subject) for s in rows if s.stream == subjects.TELEMETRY}
    assert telemetry_jobs == {"a-000001"}  # the other job's telemetry stays out; its control events stay in
    assert {subjects.job_of(s.subject) for s in rows if s.stream == subjects.CONTROL} >= {"a-000001", "b-000002"}
    data_dir = tmp_path / "data"

    # the real CLI, writing to a pipe as `flightdeck export JOB > job.fdh` does
    exported = subprocess.run([*CLI, "export", "a-000001", "--nats",
                               nats_server.url, "--data-dir", str(data_dir)], capture_output=True, cwd=ROOT,
                              timeout=30)
    assert exported.returncode == 0, exported.stderr
    assert _key(fdh.load(exported.stdout)) == _key(rows)  # the output too: an export is whole
    assert b"2 FD_LOGS" in exported.stderr
    (tmp_path / "a.fdh").write_bytes(exported.stdout)

    code, before, err = cli(capsys, "replay", "a-000001", "--json", "--nats", nats_server.url,
                            "--data-dir", str(data_dir))
    assert code == 0, err
    code, out, err = cli(capsys, "import", str(tmp_path / "a.fdh"), "--data-dir", str(data_dir))
    assert code == 0 and "imported a-000001" in out, err
    nats_server.stop()  # from here on the history comes from the library alone

    code, after, err = cli(capsys, "replay", "a-000001", "--json", "--data-dir", str(data_dir), "--nats",
                           nats_server.url)
    assert code == 0, err
    expect: dict[str, Any] = json.loads(before)
    got: dict[str, Any] = json.loads(after)
    assert got.pop("source").startswith(f"imported history {data_dir}") and expect.pop("source")
    assert got == expect
    # exporting the imported history gives back the same rows; importing it again changes nothing
    code, out, err = cli(capsys, "export", "a-000001", "--data-dir", str(data_dir), "--out", str(tmp_path / "b.fdh"))
    assert code == 0, err
    assert _key(fdh.load(tmp_path / "b.fdh")) == _key(rows)
    code, out, err = cli(capsys, "import", str(tmp_path / "b.fdh"), "--data-dir", str(data_dir))
    assert code == 0, err


def test_a_bad_file_is_refused_and_nothing_is_imported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fixture = ROOT / "tests" / "fixtures" / "histories" / "spike.fdh.jsonl"
    lines = fixture.read_bytes().splitlines()
    bad = tmp_path / "bad.fdh"
    bad.write_bytes(b"\n".join([*lines[:10], b"{oops", *lines[10:]]))
    code, out, err = cli(capsys, "import", str(bad), "--data-dir", str(tmp_path / "data"))
    assert code == 1 and f"{bad}: line 11: not JSON" in err and out == ""
    assert not (tmp_path / "data").exists()
    good = tmp_path / "good.fdh"
    good.write_bytes(fixture.read_bytes())
    code, out, err = cli(capsys, "import", str(good), "--data-dir", str(tmp_path / "data"))
    assert code == 0 and "imported spike-000001" in out
    changed = tmp_path / "changed.fdh"
    changed.write_bytes(b"\n".join(lines[:-1]) + b"\n")  # the same job, one message short
    code, out, err = cli(capsys, "import", str(changed), "--data-dir", str(tmp_path / "data"))
    assert code == 1 and "already holds a different history" in err
    assert len(fdh.load(tmp_path / "data" / "histories" / "spike-000001.fdh")) == len(lines)
