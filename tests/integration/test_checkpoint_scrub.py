"""The checkpoint service scrubs the store (issue 16): it reads committed checkpoints back at a bounded rate,
oldest-verified first and one at a time, and records each finding as CheckpointScrubbed. A shard flipped in the
store after its commit is found, named with both hashes, and the checkpoint is deleted as bad (never restored,
not counted among the kept ones); `flightdeck checkpoints` shows when each was verified and the bad one as bad."""

import asyncio
import subprocess
from pathlib import Path

import pytest

from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointScrubbed
from flightdeck.events.job import JobCompleted
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.services.checkpoints.core import SCRUBBED_BAD, checkpoint_id
from flightdeck.services.checkpoints.service import SCRUB_EVERY_ENV, SCRUB_MB_S_ENV
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.tools.audit.settle import verify_live
from tests.integration.lifecycle_harness import Objects, objects, open_platform
from tests.integration.s3_fixture import moto_s3
from tests.integration.test_checkpoint_fallback import flipped
from tests.integration.test_postmortem_cli import CLI

__all__ = ["moto_s3", "objects"]  # fixtures

SPEC = JobSpec(name="scrub", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=30, checkpoint_every=10, data="synthetic"))
MB_S = 0.5  # ~0.7 MB checkpoints: each read back takes over a second, so the rate bound shows in its time


@pytest.mark.timeout(240)
async def test_the_scrubber_finds_a_shard_flipped_in_the_store_and_the_checkpoint_is_deleted_as_bad(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch) -> None:
    job = "scrub-000001"
    ids = [checkpoint_id(0, s) for s in (10, 20, 30)]
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        p.start_all()
        await p.ready("n1")
        await p.submit(SPEC, job)
        await p.until(lambda: bool(p.seen(JobCompleted, job)), 120, "the job to complete", job)
        # A commit can be stored after JobCompleted (the ranks are done once they have staged it)
        await p.until(lambda: len(p.seen(CheckpointCommitted, job)) >= len(ids), 60, "its three commits", job)
        # The three sets may commit in any order: staged together, each is read back and committed on its own.
        committed = [e.checkpoint_id for e in p.seen(CheckpointCommitted, job)]
        assert sorted(committed) == ids
        assert p.stop("checkpoints") == 0  # it ran with the default (a day): nothing was due yet
        monkeypatch.setenv(SCRUB_EVERY_ENV, "2")  # its settings are recorded again when it comes back
        monkeypatch.setenv(SCRUB_MB_S_ENV, str(MB_S))
        p.service("checkpoints")

        def scrubbed() -> list[CheckpointScrubbed]:
            return p.seen(CheckpointScrubbed, job)

        await p.until(lambda: len(scrubbed()) >= 3, 60, "a first round of scrubs", job)
        first = scrubbed()[:3]
        assert [e.checkpoint_id for e in first] == committed  # oldest verified (here: committed) first
        assert all(e.cause == "" for e in first), [e.cause for e in first]
        for e in first:  # read back whole, never faster than the bound (the manifest itself is not paced)
            assert e.bytes > 500_000 and e.seconds >= 0.9 * e.bytes / (MB_S * 1e6), (e.bytes, e.seconds)
        history = p.job(job)
        at = [history.index(e) for e in first]
        assert at == sorted(at)

        bad = ids[1]  # kept, and verified once already: now a shard changes in the store under it
        async with objects.open() as store:
            keys = [k for k in await store.list(mf.prefix(job, bad)) if not k.endswith(mf.MANIFEST)]
            sizes = {k: len(await store.get_bytes(k)) for k in keys}
            shard = max(sizes, key=lambda k: sizes[k])
            await store.put_bytes(shard, flipped(await store.get_bytes(shard)))
        await p.until(lambda: any(e.cause for e in scrubbed()), 60, "the scrubber to find it", job)
        (found,) = [e for e in scrubbed() if e.cause]
        assert found.checkpoint_id == bad and found.step == 20
        assert shard.rsplit("/", 1)[-1] in found.cause and "sha256" in found.cause, found.cause
        await p.until(lambda: any(e.checkpoint_id == bad for e in p.seen(CheckpointDeleted, job)), 30,
                      "the bad checkpoint to be deleted", job)
        deleted = [e for e in p.seen(CheckpointDeleted, job) if e.checkpoint_id == bad]
        assert [e.reason for e in deleted] == [SCRUBBED_BAD]
        assert not any(e.checkpoint_id != bad for e in p.seen(CheckpointDeleted, job))  # the good ones stay

        run = await asyncio.to_thread(subprocess.run, [*CLI, "checkpoints", job, "--nats", p.url],
                                      capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        rows = {line.split()[0]: line for line in run.stdout.splitlines()[1:]}
        assert "BAD (" in rows[bad] and "deleted" in rows[bad] and "sha256" in rows[bad], run.stdout
        for good in (ids[0], ids[2]):
            assert rows[good].split()[7] == "kept", run.stdout
        verdict = await verify_live(p.store, job)
        assert verdict.ok, verdict.divergences[:2]  # the scrubs are effects a replay asks for again
    finally:
        await p.close()
