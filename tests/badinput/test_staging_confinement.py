"""A CheckpointStaged names the folder its node's agent uploads from, and anyone who may publish the job's
telemetry can write one. The agent (services/agent/shipping.py, its staging root the one its ranks stage under)
uploads only a set of that job's inside the root, after symlinks: a folder outside it, `..` climbing out, a
symlinked set or shard leading out, another job's set, a relative or missing path each end in CheckpointFailed
naming the dir, with nothing left in the object store. Real files and symlinks; the agent's store step, the pure
core and the commit it asks for, and once through a live agent shipper and checkpoint service on a real broker."""

import asyncio
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointStaged,
    DataPosition,
    ShardInfo,
    ShardsUploaded,
)
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobSubmitted
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.services.agent.shipping import Shipper
from flightdeck.services.checkpoints import service as checkpoint_service
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.open import OBJECTS_ENV
from flightdeck.services.shell.runtime import ConsumerPolicy, run_service
from tests.integration.runtime_helpers import eventually, read_all
from tests.integration.shipping_helpers import ship_and_commit

pytestmark = pytest.mark.timeout(60)
JOB, OTHER = "job-s", "job-o"


def write_set(folder: Path, files: dict[str, bytes]) -> list[ShardInfo]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return [ShardInfo(path=n, size=len(d), sha256=hashlib.sha256(d).hexdigest()) for n, d in files.items()]


def staged(staging_dir: str, shards: list[ShardInfo], *, rank: int = 0, world: int = 1, step: int = 5,
           job_id: str = JOB) -> CheckpointStaged:
    return CheckpointStaged(job_id=job_id, rank=rank, attempt=0, node="n0", step=step, world_size=world,
                            staging_dir=staging_dir, shards=shards, data=DataPosition(next_batch=step), stall_s=0.0,
                            write_s=0.0, event_id=f"st-{job_id}-{step}-{rank}", occurred_at=10.0)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(OBJECTS_ENV, str(tmp_path / "objects"))
    (tmp_path / "staging" / JOB).mkdir(parents=True)
    return tmp_path / "staging"


@pytest.fixture
def secret(tmp_path: Path) -> tuple[Path, list[ShardInfo]]:
    """A file the service can read and the announcer knows the size and sha256 of, outside the staging root."""
    folder = tmp_path / "private"
    return folder, write_set(folder, {"credentials": b"token=hunter2\n" * 100})


async def run_commit(stagings: list[CheckpointStaged], tmp_path: Path, roots: list[Path] | None = None
                     ) -> CheckpointCommitted | CheckpointFailed:
    """Each rank's agent stores its set from the staging root, then the checkpoint service commits."""
    return await ship_and_commit(LocalStore(tmp_path / "objects"), stagings, roots or [tmp_path / "staging"])


def objects(tmp_path: Path) -> list[str]:
    base = tmp_path / "objects" / "checkpoints"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()) if base.exists() else []


async def test_a_set_of_the_jobs_inside_the_root_commits(root: Path, tmp_path: Path) -> None:
    shards = write_set(root / JOB / "step-5", {"__0_0.distcp": os.urandom(5000), ".metadata": b"m"})
    out = await run_commit([staged(str(root / JOB / "step-5"), shards)], tmp_path)
    assert isinstance(out, CheckpointCommitted), out
    assert objects(tmp_path) == [f"{JOB}/step000000005-a0/{n}" for n in (".metadata", "MANIFEST.json", "__0_0.distcp")]


async def test_a_root_reached_through_a_symlink_still_commits(tmp_path: Path, root: Path) -> None:
    os.symlink(root, tmp_path / "staging-link")
    shards = write_set(root / JOB / "step-5", {"__0_0.distcp": b"x" * 100})
    out = await run_commit([staged(str(tmp_path / "staging-link" / JOB / "step-5"), shards)], tmp_path,
                           [tmp_path / "staging-link"])
    assert isinstance(out, CheckpointCommitted), out


Announce = Callable[[Path, Path, Path], str]  # (staging root, tmp, the secret's folder) -> the dir announced


def _outside(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    return str(secret_dir)


def _dotdot(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    return f"{root}/{JOB}/../../private"


def _set_links_out(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    os.symlink(secret_dir, root / JOB / "step-5")  # the set itself is a link out of the root
    return f"{root}/{JOB}/step-5"


def _the_root_itself(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    os.link(secret_dir / "credentials", root / "credentials")  # even a file really in the root: not a job's set
    return str(root)


def _the_job_folder(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    os.link(secret_dir / "credentials", root / JOB / "credentials")
    return str(root / JOB)


def _another_jobs_set(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    (root / OTHER / "step-5").mkdir(parents=True)
    os.link(secret_dir / "credentials", root / OTHER / "step-5" / "credentials")
    return str(root / OTHER / "step-5")


def _link_to_another_jobs_set(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    _another_jobs_set(root, tmp_path, secret_dir)
    os.symlink(root / OTHER / "step-5", root / JOB / "step-5")
    return str(root / JOB / "step-5")


def _relative(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    return os.path.relpath(secret_dir)


def _missing(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    return str(root / JOB / "step-404")


def _symlink_loop(root: Path, tmp_path: Path, secret_dir: Path) -> str:
    os.symlink(root / JOB / "loop-b", root / JOB / "loop-a")
    os.symlink(root / JOB / "loop-a", root / JOB / "loop-b")
    return str(root / JOB / "loop-a")


@pytest.mark.parametrize(("announce", "says"), [
    (_outside, "outside the staging roots"), (_dotdot, "outside the staging roots"),
    (_set_links_out, "outside the staging roots"), (_the_root_itself, "outside the staging roots"),
    (_the_job_folder, f"not a set of job {JOB}'s"), (_another_jobs_set, f"not a set of job {JOB}'s"),
    (_link_to_another_jobs_set, f"not a set of job {JOB}'s"), (_relative, "not an absolute path"),
    (_missing, "cannot be resolved"), (_symlink_loop, "cannot be resolved"),
])
async def test_a_staging_dir_that_is_not_the_jobs_set_under_the_root_uploads_nothing(
        announce: Announce, says: str, root: Path, tmp_path: Path, secret: tuple[Path, list[ShardInfo]]) -> None:
    secret_dir, shards = secret
    # the honest rank 0 staged a good set; the hostile rank 1's announcement dooms the whole checkpoint
    good = write_set(root / JOB / "step-5-r0", {"__0_0.distcp": b"g" * 64})
    out = await run_commit([staged(str(root / JOB / "step-5-r0"), good, world=2),
                            staged(announce(root, tmp_path, secret_dir), shards, rank=1, world=2)], tmp_path)
    assert isinstance(out, CheckpointFailed), out
    assert "node n0 could not store its ranks' shards: rank 1 announced the staging dir" in out.reason, out.reason
    assert says in out.reason, out.reason
    assert "nothing was uploaded" in out.reason
    assert objects(tmp_path) == []
    assert (secret_dir / "credentials").read_bytes() == b"token=hunter2\n" * 100  # and nothing was removed


@pytest.mark.parametrize("link", ["absolute", "climbing"])
async def test_a_shard_that_links_out_of_its_set_uploads_nothing(
        link: str, root: Path, tmp_path: Path, secret: tuple[Path, list[ShardInfo]]) -> None:
    secret_dir, (info,) = secret
    folder = root / JOB / "step-5"
    good = write_set(folder, {".metadata": b"m"})
    target = secret_dir / "credentials" if link == "absolute" else Path("../../../private/credentials")
    os.symlink(target, folder / "__0_0.distcp")
    assert (folder / "__0_0.distcp").read_bytes() == (secret_dir / "credentials").read_bytes()
    shard = ShardInfo(path="__0_0.distcp", size=info.size, sha256=info.sha256)
    out = await run_commit([staged(str(folder), [*good, shard])], tmp_path)
    assert isinstance(out, CheckpointFailed), out
    assert "__0_0.distcp" in out.reason and "outside" in out.reason, out.reason
    assert objects(tmp_path) == []


@pytest.mark.timeout(60)
async def test_through_a_live_agent_and_service_a_hostile_staging_fails_and_a_good_one_commits(
        nats_server: broker_mod.Broker, root: Path, tmp_path: Path, secret: tuple[Path, list[ShardInfo]]) -> None:
    secret_dir, shards = secret
    store = await JetStreamStore.connect(nats_server.url, name="staging-test")
    stop = asyncio.Event()
    task = asyncio.create_task(run_service(checkpoint_service.build(), nats_server.url, stop_event=stop,
                                           policy=ConsumerPolicy(fetch_s=0.2)))
    shipper = Shipper(node="n0", producer="agent-n0", store=store, objects=LocalStore(tmp_path / "objects"),
                      staging=root)
    try:
        spec = JobSpec(name="s", slots=1, train=TrainSpec(steps=100, checkpoint_every=5))
        await append_to_job(store, JobSubmitted(job_id=JOB, spec=spec, event_id="sub", occurred_at=1.0, producer="cli"))
        shipper.watch(JOB, 0, [0], await shipper.start_seq())
        await store.append(subjects.telemetry(JOB, 0, "CheckpointStaged"), staged(str(secret_dir), shards))
        good = write_set(root / JOB / "step-10", {"__0_0.distcp": os.urandom(3000), ".metadata": b"m"})
        await store.append(subjects.telemetry(JOB, 0, "CheckpointStaged"),
                           staged(str(root / JOB / "step-10"), good, step=10))

        async def decided() -> bool:
            assert not task.done(), task
            return len([s for s in await read_all(store, subjects.CONTROL)
                        if isinstance(s.event, CheckpointFailed | CheckpointCommitted)]) == 2
        await eventually(decided, 30, "the checkpoint service to record both outcomes")
        await shipper.finish(JOB, 0)
        reports = [s.event for s in await read_all(store, subjects.TELEMETRY) if isinstance(s.event, ShardsUploaded)]
        assert [(r.step, r.ranks, r.node, bool(r.failed)) for r in reports] == [(5, [0], "n0", True),
                                                                                (10, [0], "n0", False)]
        outcomes = [s.event for s in await read_all(store, subjects.CONTROL)
                    if isinstance(s.event, CheckpointFailed | CheckpointCommitted)]
        fail, done = outcomes
        assert isinstance(fail, CheckpointFailed) and "outside the staging roots" in fail.reason, fail
        assert isinstance(done, CheckpointCommitted) and done.step == 10, done
        assert objects(tmp_path) == [f"{JOB}/step000000010-a0/{n}" for n in (".metadata", "MANIFEST.json",
                                                                              "__0_0.distcp")]
    finally:
        await shipper.close()
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()
