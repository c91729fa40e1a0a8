"""A shard damaged in the object store between its agent storing it and the checkpoint service committing
it: the service reads every shard back, so the checkpoint fails naming the shard and its rank's announced
hash, nothing of it stays in the object store, and the previous checkpoint stays the newest committed one.
(A shard damaged on the node before its agent stores it is refused by the agent: test_objectstore_checkpoints.)

Made deterministic rather than raced against the service's 1 Hz telemetry fold: the checkpoint service
is not running while the ranks stage and the agent stores their shards; the test damages a stored object,
then starts the service, which folds the stagings and the agent's reports from the stream. Rank 0 then sleeps
inside step 20 (a `slow` drill fault), so no further checkpoint is taken and the job is still running when the
service reads the stream."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointStaged, ShardsUploaded
from flightdeck.events.job import WorkersExited
from flightdeck.events.spec import FaultSpec, JobSpec, ModelSpec, PolicySpec, TrainSpec
from flightdeck.services.checkpoints.core import checkpoint_id
from flightdeck.services.shell import broker as broker_mod
from tests.integration.lifecycle_harness import SERVICES, Objects, local_objects, open_platform
from tests.integration.test_lifecycle_services import ROOT

__all__ = ["local_objects"]  # fixture

JOB = "corrupt-000001"
SPEC = JobSpec(name="corrupt", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=1000, checkpoint_every=10, data="synthetic"),
               policy=PolicySpec(hang_min_s=3600.0),  # the sleeping rank is held on purpose, not hung
               faults=[FaultSpec(kind="slow", step=20, rank=0, seconds=600.0)])


def flip(path: Path) -> None:
    """Invert a few bytes in the middle of the file, keeping its size: only the hash can tell."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
async def test_a_corrupted_shard_fails_its_checkpoint_and_the_previous_one_stays_newest(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    c = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        c.start_all(tuple(s for s in SERVICES if s != "checkpoints"))
        await c.ready()
        await c.submit(SPEC, JOB)

        def staged(step: int) -> dict[int, CheckpointStaged]:
            return {e.rank: e for e in c.seen(CheckpointStaged, JOB, stream=subjects.TELEMETRY) if e.step == step}

        def stored(step: int) -> set[int]:
            return {r for e in c.seen(ShardsUploaded, JOB, stream=subjects.TELEMETRY)
                    if e.step == step and not e.failed for r in e.ranks}

        await c.until(lambda: len(staged(10)) == 2 and stored(20) == {0, 1}, 60,
                      "both ranks to stage steps 10 and 20, and the agent to store them", JOB)
        victim = staged(20)[1]
        shard = max(victim.shards, key=lambda s: s.size)  # rank 1's DCP data file
        flip(Path(local_objects.url) / "checkpoints" / JOB / checkpoint_id(0, 20) / shard.path)

        c.service("checkpoints")
        await c.until(lambda: bool(c.seen(CheckpointFailed, JOB)) and bool(c.seen(CheckpointCommitted, JOB)), 60,
                      "the checkpoint service to commit step 10 and fail step 20", JOB)
        (failed,) = c.seen(CheckpointFailed, JOB)
        (committed,) = c.seen(CheckpointCommitted, JOB)
        bad, good = checkpoint_id(0, 20), checkpoint_id(0, 10)
        assert failed.step == 20 and committed.step == 10 and committed.checkpoint_id == good
        for words in (bad, repr(shard.path), "of rank 1", "does not match its rank's announcement", shard.sha256):
            assert words in failed.reason, (words, failed.reason)
        assert c.seen(WorkersExited, JOB) == []  # the job still runs: the failure was the checkpoint's alone

        async def nothing_of_the_failed_one() -> bool:  # its uploaded shards are removed after the failure
            return await local_objects.keys(JOB, bad) == []

        await c.eventually(nothing_of_the_failed_one, 60, f"the store to hold nothing of {bad}")
        assert await local_objects.manifests(JOB) == [good]
        assert (Path(local_objects.url) / "checkpoints" / JOB / good / "MANIFEST.json").is_file()

        cli = [sys.executable, "-m", "flightdeck.services.tools.console", "checkpoints", JOB, "--json", "--nats", c.url]
        out = await asyncio.to_thread(subprocess.run, cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        assert [(e["checkpoint_id"], e["deleted"]) for e in listed] == [(good, False)]
    finally:
        await c.close()
