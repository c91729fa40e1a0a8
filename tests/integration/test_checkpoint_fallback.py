"""A restart whose checkpoint turns out bad falls back to the newest good one (issue 16): the node agent refuses
the download by its manifest, records CheckpointRejected naming the file and both hashes before the exits it
causes, and the scheduler restarts from the next checkpoint without spending the restart budget. With no good
checkpoint left, the job fails once, saying so. Nothing corrupt is ever loaded.

Deterministic: rank 0 sleeps inside step 31 (a `slow` drill fault) once steps 10, 20 and 30 are committed, the
test damages checkpoints in the object store and removes the node's cached copies (so the agent must download
them), then kills rank 1: that crash is the restart."""

import asyncio
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace

from flightdeck.events import subjects
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointRefused,
    CheckpointRejected,
    CheckpointScrubbed,
)
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.fleet import NodeCordoned
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    JobCompleted,
    JobFailed,
    JobResumed,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.nodelocal import RESTORE_REFUSED_EXIT
from flightdeck.events.spec import EntrypointSpec, FaultSpec, JobSpec, ModelSpec, PolicySpec, TrainSpec
from flightdeck.events.training import RankStarted, RolledBack
from flightdeck.services.agent.spawner import START_FAILED_EXIT
from flightdeck.services.checkpoints.core import CONFIRMED, checkpoint_id
from flightdeck.services.resources.core import BLIND_CORDON
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.tools.audit.settle import verify_live
from tests.integration.lifecycle_harness import Objects, Platform, local_objects, objects, open_platform
from tests.integration.s3_fixture import moto_s3
from tests.integration.test_lifecycle_services import ROOT, kinds
from tests.integration.test_postmortem_cli import CLI

__all__ = ["local_objects", "moto_s3", "objects"]  # fixtures

SPEC = JobSpec(name="fallback", slots=2, model=ModelSpec(d_model=32),
               # no snapshots in memory: the kill would persist step 31, and these restarts are about the store's
               train=TrainSpec(steps=50, checkpoint_every=10, data="synthetic", snapshot_every=0),
               policy=PolicySpec(hang_min_s=3600.0),  # the sleeping rank is held on purpose, not hung
               faults=[FaultSpec(kind="slow", step=31, rank=0, seconds=600.0)])  # fires once: attempt 0 only


async def hold_after_three_commits(p: Platform, job: str, spec: JobSpec = SPEC) -> list[int]:
    """Start the job and wait until steps 10, 20 and 30 are committed and cached; the pids of attempt 0."""
    p.start_all()  # the services and agent n1
    await p.ready("n1")
    await p.submit(spec, job)
    await p.until(lambda: {e.step for e in p.seen(CheckpointCommitted, job)} >= {10, 20, 30}, 90,
                  "commits of steps 10, 20 and 30", job)
    cache = p.data / "cache" / job
    await p.until(lambda: all((cache / checkpoint_id(0, s) / "MANIFEST.json").exists() for s in (10, 20, 30)), 30,
                  "the agent to cache them", job)
    (started,) = p.seen(WorkersStarted, job)
    return list(started.pids)


async def postmortem_report(p: Platform, job: str, tmp_path: Path) -> str:
    """`flightdeck postmortem` of the job as a user runs it; its report.md."""
    out = tmp_path / "pm"
    run = await asyncio.to_thread(subprocess.run, [*CLI, "postmortem", job, "--out", str(out), "--nats", p.url,
                                                   "--data-dir", str(tmp_path / "none")],
                                  capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return (out / "report.md").read_text()


def largest_shard(folder: Path) -> Path:
    return max((f for f in folder.iterdir() if f.name != mf.MANIFEST), key=lambda f: f.stat().st_size)


def flipped(data: bytes) -> bytes:
    """A few bytes in the middle inverted, the size kept: only the hash can tell."""
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 8]) + data[mid + 8:]


async def damage(p: Platform, objects: Objects, job: str, step: int, *, store: str = "flipped",
                 cache: str = "missing") -> str:
    """Damage attempt 0's checkpoint of `step`: in the store, its largest shard "flipped" or "deleted", or its
    manifest "truncated" ("": left alone); the node's copy "missing", "flipped" the same way, or "" left alone.
    Returns the shard's name."""
    cid = checkpoint_id(0, step)
    cached = p.data / "cache" / job / cid
    shard = largest_shard(cached).name
    async with objects.open() as bucket:
        key = mf.shard_key(job, cid, shard)
        if store == "flipped":
            await bucket.put_bytes(key, flipped(await bucket.get_bytes(key)))
        elif store == "deleted":
            await bucket.delete(key)
        elif store == "truncated":
            raw = await bucket.get_bytes(mf.manifest_key(job, cid))
            await bucket.put_bytes(mf.manifest_key(job, cid), raw[:len(raw) // 2])
    if cache == "missing":
        shutil.rmtree(cached)
    elif cache == "flipped":
        (cached / shard).write_bytes(flipped((cached / shard).read_bytes()))
    return shard


async def crash_after_damage(p: Platform, objects: Objects, job: str, steps: tuple[int, ...], *,
                             spec: JobSpec = SPEC, **how: Any) -> str:
    """Hold the job after three commits, damage the checkpoints of `steps` (`how`: see damage), SIGKILL rank 1 (the
    crash that makes the restart), and wait for the job to end either way; the damaged shard's name."""
    pids = await hold_after_three_commits(p, job, spec)
    shards = [await damage(p, objects, job, step, **how) for step in steps]
    os.kill(pids[1], signal.SIGKILL)
    await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
    return shards[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("objects", "cache"), [("local", "missing"), ("local", "flipped"), ("s3", "flipped")],
                         indirect=["objects"])
async def test_a_bad_newest_checkpoint_is_rejected_and_the_restart_falls_back_for_free(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects, cache: str) -> None:
    """Bad in the store, and the node's copy gone or damaged the same way."""
    job = "fallback-000001"
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        shard = await crash_after_damage(p, objects, job, (30,), cache=cache)
        assert p.seen(JobCompleted, job), kinds(p.job(job))

        (rejected,) = p.seen(CheckpointRejected, job)
        assert (rejected.checkpoint_id, rejected.step, rejected.attempt, rejected.node) == \
               (checkpoint_id(0, 30), 30, 1, "n1")
        assert shard in rejected.cause and "sha256" in rejected.cause, rejected.cause
        history = p.job(job)
        exits_1 = [i for i, e in enumerate(history) if isinstance(e, WorkersExited) and e.attempt == 1]
        assert history.index(rejected) < exits_1[0]  # recorded before the exits it caused
        assert sorted(e.rank for e in p.rank_exits(job) if e.attempt == 1) == [0, 1]
        assert {e.exit_code for e in p.rank_exits(job) if e.attempt == 1} == {START_FAILED_EXIT}

        resumed = {e.attempt: e for e in p.seen(JobResumed, job)}
        assert (resumed[2].from_step, resumed[2].checkpoint_id) == (20, checkpoint_id(0, 20))
        started = {e.from_step for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == 2}
        assert started == {20}  # what the ranks loaded: the good one, never the bad one
        assert not any(e.attempt == 1 for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY))

        releases = [e.reason for e in p.seen(AllocationReleased, job)]
        assert sum("restart 1 of 3" in r for r in releases) == 1  # the crash spent one restart ...
        assert sum("without spending the restart budget" in r for r in releases) == 1  # ... the bad checkpoint none
        assert not any("restart 2 of 3" in r for r in releases)
        assert not (p.data / "cache" / job / checkpoint_id(0, 30)).exists()  # evicted on every node
        # n1's claim alone deletes nothing: the checkpoint service read it back itself and found it bad too
        (read,) = [e for e in p.seen(CheckpointScrubbed, job) if e.claim_node]
        assert (read.checkpoint_id, read.claim_node) == (checkpoint_id(0, 30), "n1") and read.cause, read
        assert history.index(rejected) < history.index(read)
        bad = [e for e in p.seen(CheckpointDeleted, job) if e.checkpoint_id == checkpoint_id(0, 30)]
        assert [e.reason for e in bad] == [CONFIRMED]  # and deleted from the store, not counted as a kept one
        assert (await verify_live(p.store, job)).ok  # `flightdeck verify` re-derives the fallback
    finally:
        await p.close()


@pytest.mark.timeout(240)
async def test_a_damaged_cached_copy_is_downloaded_again_and_restored(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects) -> None:
    """Bad only on the node: its copy is checked before a restart, evicted and fetched again from the store."""
    job = "fallback-000003"
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        await crash_after_damage(p, objects, job, (30,), store="", cache="flipped")
        assert p.seen(JobCompleted, job) and p.seen(CheckpointRejected, job) == [], kinds(p.job(job))
        (resumed,) = p.seen(JobResumed, job)
        assert (resumed.attempt, resumed.from_step) == (1, 30)
        assert {e.from_step for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == 1} == {30}
        assert "cached checkpoint damaged; downloading it again" in (tmp_path / "agent-n1.log").read_text()
    finally:
        await p.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("objects", ["s3"], indirect=True)
async def test_with_no_good_checkpoint_left_the_job_fails_once_naming_them(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects) -> None:
    job = "fallback-000002"
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        await crash_after_damage(p, objects, job, (10, 20, 30))
        assert [(e.step, e.attempt) for e in p.seen(CheckpointRejected, job)] == [(30, 1), (20, 2), (10, 3)]
        (failed,) = p.seen(JobFailed, job)
        assert "no good checkpoint is left" in failed.reason and checkpoint_id(0, 10) in failed.reason, failed.reason
        rejected_ids = {e.event_id for e in p.seen(CheckpointRejected, job)}
        assert rejected_ids <= set(failed.causes)
        assert not p.seen(JobCompleted, job) and kinds(p.job(job)).count("JobFailed") == 1
        assert not any(e.attempt > 0 for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY))

        out = tmp_path / "pm"  # a postmortem names the bad checkpoints and why the job gave up
        run = await asyncio.to_thread(subprocess.run, [*CLI, "postmortem", job, "--out", str(out), "--nats", p.url,
                                                       "--data-dir", str(tmp_path / "none")],
                                      capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "no good checkpoint is left" in run.stdout, run.stdout
        report = (out / "report.md").read_text()
        for step in (10, 20, 30):
            assert f"checkpoint {checkpoint_id(0, step)} (step {step}) rejected by n1" in report, report[-3000:]
        assert (await verify_live(p.store, job)).ok
    finally:
        await p.close()


@pytest.mark.timeout(240)
async def test_a_truncated_manifest_and_a_deleted_shard_are_rejected_in_turn(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects) -> None:
    """Step 30's manifest cut in half, step 20's largest shard gone from the store (neither cached): each restart
    names what it found, costs nothing, and the third restores step 10."""
    job = "fallback-000004"
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        pids = await hold_after_three_commits(p, job)
        await damage(p, objects, job, 30, store="truncated")
        shard = await damage(p, objects, job, 20, store="deleted")
        os.kill(pids[1], signal.SIGKILL)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), kinds(p.job(job))
        rejected = p.seen(CheckpointRejected, job)
        assert [(e.step, e.attempt) for e in rejected] == [(30, 1), (20, 2)]
        assert "manifest" in rejected[0].cause and shard in rejected[1].cause and "missing" in rejected[1].cause, \
            [e.cause for e in rejected]
        started = {e.attempt: e.from_step for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)}
        assert started == {0: 0, 3: 10}
        releases = [e.reason for e in p.seen(AllocationReleased, job)]
        assert sum("without spending the restart budget" in r for r in releases) == 2
        assert not any("restart 2 of 3" in r for r in releases)
        assert (await verify_live(p.store, job)).ok
    finally:
        await p.close()


# A crash at step 31 restarts the job from step 30; a NaN loss at step 35 then rolls it back to step 20 at least
# 10 steps before it (policy.rollback_steps_back), in the running ranks. From step 36 on, steps take a second, so
# the rollbacks land long before the last step.
ROLLBACK_SPEC = replace(SPEC, policy=replace(SPEC.policy, rollback_steps_back=10),
                        faults=[*SPEC.faults, FaultSpec(kind="nonfinite", step=35, rank=0, attempt=1),
                                FaultSpec(kind="slow", step=36, rank=0, seconds=1.0, attempt=1)])


@pytest.mark.timeout(240)
async def test_a_rollback_whose_checkpoint_is_bad_rolls_back_further_without_a_restart(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects) -> None:
    """Step 20's shard gone from the store and its node copy removed: the agent cannot fetch it for the rollback, so
    the ranks refuse it (CheckpointRefused, naming the shard) and the scheduler rolls back to step 10 instead, whose
    removed node copy the agent downloads again (a cache miss downloads)."""
    job = "fallback-000005"
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        pids = await hold_after_three_commits(p, job, ROLLBACK_SPEC)
        shard = await damage(p, objects, job, 20, store="deleted")
        await damage(p, objects, job, 10, store="", cache="missing")
        os.kill(pids[1], signal.SIGKILL)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), ([e.reason for e in p.seen(JobFailed, job)], kinds(p.job(job)))

        first, again = p.seen(RollbackRequested, job)
        assert (first.checkpoint_id, again.checkpoint_id) == (checkpoint_id(0, 20), checkpoint_id(0, 10))
        assert (again.skip_from, again.skip_to, again.attempt) == (first.skip_from, first.skip_to, 1)
        assert again.reason.startswith(f"checkpoint {checkpoint_id(0, 20)} (step 20) is bad on n1"), again.reason
        refused = p.seen(CheckpointRefused, job, stream=subjects.TELEMETRY)
        assert refused and {(e.checkpoint_id, e.attempt) for e in refused} == {(checkpoint_id(0, 20), 1)}
        assert all(shard in e.cause for e in refused), [e.cause for e in refused]
        rolled = p.seen(RolledBack, job, stream=subjects.TELEMETRY)
        assert sorted((e.rank, e.checkpoint_id, e.to_step) for e in rolled) == \
               [(0, checkpoint_id(0, 10), 10), (1, checkpoint_id(0, 10), 10)]  # never the bad one

        assert {e.attempt for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)} == {0, 1}  # no restart
        assert [e.checkpoint_id for e in p.seen(CheckpointDeleted, job) if e.reason == CONFIRMED] == \
               [checkpoint_id(0, 20)]  # once the checkpoint service's read found it bad too
        assert "rollback refused" in p.logs()
        assert (await verify_live(p.store, job)).ok  # `flightdeck verify` re-derives both rollbacks

        report = await postmortem_report(p, job, tmp_path)  # names the bad one and the rollback past it
        assert f"checkpoint {checkpoint_id(0, 20)} (step 20) refused by rank" in report, report[-3000:]
        assert f"roll back to {checkpoint_id(0, 10)} (step 10)" in report, report[-3000:]
    finally:
        await p.close()


# An entrypoint that rots the node's copy of its restore checkpoint in attempt 1, after the agent checked it and
# before the ranks load it (rank 0 damages it, rank 1 waits for that), then runs the built-in trainer.
ROT_THEN_TRAIN = """
import os, pathlib, runpy, time
restore = os.environ.get("FLIGHTDECK_RESTORE")
if restore and os.environ["FLIGHTDECK_ATTEMPT"] == "1":
    done = pathlib.Path(restore).with_name("rotted")
    if os.environ["RANK"] == "0":
        shard = max(pathlib.Path(restore).glob("*.distcp"), key=lambda f: f.stat().st_size)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        done.touch()
    while not done.exists():
        time.sleep(0.05)
runpy.run_module("flightdeck.trainer", run_name="__main__")
"""


@pytest.mark.timeout(240)
async def test_a_checkpoint_rotted_on_its_node_is_refused_there_and_restored_intact_from_another(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    """The rank refuses before loading anything (exit 65); its agent records CheckpointRejected with the rank's
    reason before the exits, so the restart is free. The store's copy is intact, as the checkpoint service reads
    it back: the node whose copy rotted is the suspect (cordoned), and the restart restores the same step on the
    other node. Nothing is deleted on the rotted node's word (issue 51)."""
    job = "fallback-000006"
    script = tmp_path / "rot_then_train.py"
    script.write_text(ROT_THEN_TRAIN)
    spec = replace(SPEC, entrypoint=EntrypointSpec(command=["python", str(script)], cwd=str(ROOT)))
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        pids = await hold_after_three_commits(p, job, spec)
        p.agent("n2", "--data-dir", str(tmp_path / "n2-data"))
        await p.ready("n2")
        os.kill(pids[1], signal.SIGKILL)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), kinds(p.job(job))
        (rejected,) = p.seen(CheckpointRejected, job)
        assert (rejected.checkpoint_id, rejected.attempt) == (checkpoint_id(0, 30), 1)
        assert "refused it when loading" in rejected.cause and "sha256" in rejected.cause, rejected.cause
        history = p.job(job)
        exits_1 = [i for i, e in enumerate(history) if isinstance(e, WorkersExited) and e.attempt == 1]
        assert history.index(rejected) < exits_1[0]
        # Each rank checks the checkpoint before it loads anything: the first to refuse ends the attempt, and its peer
        # refused too or was stopped by the restart before it got that far (warm ranks get there at any moment).
        codes = [e.exit_code for e in p.rank_exits(job) if e.attempt == 1]
        assert RESTORE_REFUSED_EXIT in codes and set(codes) <= {RESTORE_REFUSED_EXIT, -signal.SIGKILL}, codes
        (read,) = [e for e in p.seen(CheckpointScrubbed, job) if e.claim_node]
        assert (read.checkpoint_id, read.claim_node, read.cause) == (checkpoint_id(0, 30), rejected.node, "")
        (cordon,) = [e for e in p.seen(NodeCordoned) if e.node == rejected.node]
        assert cordon.reason.startswith(BLIND_CORDON), cordon.reason
        started = {e.attempt: e.from_step for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)}
        assert started == {0: 0, 2: 30}  # attempt 1 loaded nothing; attempt 2 the same step, intact
        (grant,) = [e for e in p.seen(AllocationGranted, job) if e.attempt == 2]
        assert rejected.node not in {r.node for r in grant.assignments}
        assert [e.reason for e in p.seen(CheckpointDeleted, job)] == ["retention"] * len(p.seen(CheckpointDeleted, job))
        releases = [e.reason for e in p.seen(AllocationReleased, job)]
        assert sum("without spending the restart budget" in r for r in releases) == 1
        assert not any("restart 2 of 3" in r for r in releases)

        report = await postmortem_report(p, job, tmp_path)  # names the refused checkpoint and the restore after it
        assert f"checkpoint {checkpoint_id(0, 30)} (step 30) rejected by {rejected.node}" in report, report[-3000:]
        assert "read back intact by the checkpoint service" in report, report[-3000:]
    finally:
        await p.close()
