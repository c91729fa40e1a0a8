"""A job's checkpoints through every service, on each object store: all committed with a manifest hash,
retention leaves exactly `keep_checkpoints` in the store, and what the store holds is what was recorded."""

import hashlib
import re

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointStaged
from flightdeck.events.job import JobCompleted
from flightdeck.events.spec import JobSpec, ModelSpec, PolicySpec, TrainSpec
from flightdeck.services.checkpoints.core import checkpoint_id
from tests.integration.lifecycle_harness import Objects, Platform, objects, platform
from tests.integration.s3_fixture import moto_s3
from tests.integration.test_lifecycle_services import exits

__all__ = ["moto_s3", "objects", "platform"]  # fixtures

KEEP = 2
SPEC = JobSpec(name="ckpt", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=30, checkpoint_every=5, data="synthetic"),
               policy=PolicySpec(keep_checkpoints=KEEP))
STEPS = list(range(5, 31, 5))  # every checkpoint_every steps, the last one (step 30) included


@pytest.mark.timeout(150)
async def test_every_checkpoint_is_committed_and_retention_keeps_k(platform: Platform, objects: Objects) -> None:
    c, job = platform, "ckpt-000001"
    await c.submit(SPEC, job)
    await c.until(lambda: bool(c.seen(JobCompleted, job)), 90, "the job to complete", job)
    assert exits(c, job, 0) == {0: 0, 1: 0}

    def committed() -> dict[int, CheckpointCommitted]:
        return {e.step: e for e in c.seen(CheckpointCommitted, job)}

    def deleted() -> set[str]:
        return {e.checkpoint_id for e in c.seen(CheckpointDeleted, job)}

    expected_ids = [checkpoint_id(0, s) for s in STEPS]
    doomed = set(expected_ids[:-KEEP])
    await c.until(lambda: sorted(committed()) == STEPS and deleted() == doomed, 30,
                  f"commits of steps {STEPS} and deletion of {sorted(doomed)}", job)
    staged = {(e.step, e.rank) for e in c.seen(CheckpointStaged, job, stream=subjects.TELEMETRY)}
    assert staged == {(s, r) for s in STEPS for r in (0, 1)}
    for step, ev in committed().items():
        assert ev.checkpoint_id == checkpoint_id(0, step) and ev.world_size == 2 and ev.bytes > 0
        assert re.fullmatch(r"[0-9a-f]{64}", ev.manifest_sha256), ev
    assert all(e.reason == "retention" for e in c.seen(CheckpointDeleted, job))

    # The store: manifests of exactly the newest K, no object left of a deleted checkpoint, and each
    # kept manifest is byte for byte the one the commit recorded.
    kept = expected_ids[-KEEP:]

    async def only_kept_in_store() -> bool:  # deletion runs after CheckpointDeleted is recorded
        return {k.split("/")[2] for k in await objects.keys(job)} == set(kept)

    await c.eventually(only_kept_in_store, 60, f"the store to hold only {kept}")
    assert await objects.manifests(job) == kept
    for cid in kept:
        body = await objects.manifest_bytes(job, cid)
        (ev,) = [e for e in committed().values() if e.checkpoint_id == cid]
        assert hashlib.sha256(body).hexdigest() == ev.manifest_sha256
        assert ev.uri.endswith(f"checkpoints/{job}/{cid}/MANIFEST.json")
        assert ev.uri.startswith("s3://" if objects.url.startswith("s3://") else "file://")
        shards = [k for k in await objects.keys(job, cid) if not k.endswith("MANIFEST.json")]
        assert len(shards) >= 2, shards  # one DCP shard per rank, plus DCP's metadata
