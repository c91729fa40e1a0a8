"""Checkpoints through an S3 endpoint that fails (500), throttles (503 SlowDown), resets connections and
stalls: a fault-injecting proxy (faultproxy.py) in front of moto over real TCP, for the agent that stores the
shards and the checkpoint service that reads them back and writes the manifest. Transient faults are retried
and the checkpoint commits; persistent ones end in CheckpointFailed with the reason, within a bounded time,
with no manifest, no leftover objects or multipart uploads, and the previous checkpoint still whole."""

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointStaged, checkpoint_id
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.retry import RetryPolicy
from flightdeck.services.shell.objects.s3 import MIN_PART_SIZE, S3Store
from tests.badinput.faultproxy import FaultProxy
from tests.integration.s3_fixture import MotoS3, moto_s3
from tests.integration.shipping_helpers import ship_and_commit, staged_files

__all__ = ["moto_s3"]
pytestmark = pytest.mark.timeout(60)

JOB = "faulty-1"
TIMEOUT_S = 1.0  # the client's read timeout: a stalled request costs this much per try
POLICY = RetryPolicy(attempts=6, base_s=0.02, cap_s=0.2, deadline_s=4.0)
# A failing store must not hold the service: the retry deadline, a few stalled tries, and slack for a loaded box and
# moto. Unbounded retrying would run into pytest's timeout, far past this; the tests assert outcomes, not speed.
HELD_AT_MOST_S = POLICY.deadline_s + 3 * TIMEOUT_S + 30


def put(method: str, path: str) -> bool:
    return method == "PUT"


def shard_put(method: str, path: str) -> bool:
    return method == "PUT" and mf.MANIFEST not in path


def manifest_put(method: str, path: str) -> bool:
    return method == "PUT" and mf.MANIFEST in path


@pytest.fixture
async def proxy(moto_s3: MotoS3) -> AsyncIterator[FaultProxy]:
    host, port = moto_s3.endpoint.removeprefix("http://").split(":")
    p = FaultProxy(host, int(port))
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def s3(moto_s3: MotoS3, proxy: FaultProxy) -> AsyncIterator[S3Store]:
    async with S3Store.open(moto_s3.bucket, endpoint_url=proxy.endpoint, part_size=MIN_PART_SIZE, max_concurrency=2,
                            retry=POLICY, connect_timeout_s=TIMEOUT_S, read_timeout_s=TIMEOUT_S,
                            try_timeout_s=2 * TIMEOUT_S) as store:
        yield store


@dataclass(frozen=True)
class Set:
    """One checkpoint's stagings, as two ranks on one node leave them."""

    checkpoint_id: str
    step: int
    root: Path
    stagings: list[CheckpointStaged]


def staged(tmp: Path, step: int) -> Set:
    """Two ranks' shards: a small one each, and one past the part size (a multipart upload)."""
    root = tmp / "staging"
    stagings = [staged_files(root, JOB, step, {f"r{rank}-{i}.distcp": os.urandom(size) for i, size in enumerate(sizes)},
                             rank=rank, world=2)
                for rank, sizes in ((0, (1000, MIN_PART_SIZE + 4096)), (1, (2000,)))]
    return Set(checkpoint_id=checkpoint_id(0, step), step=step, root=root, stagings=stagings)


async def committed(store: S3Store, args: Set) -> tuple[CheckpointCommitted | CheckpointFailed, float]:
    """The node's agent stores the shards through the endpoint, then the checkpoint service commits."""
    began = time.monotonic()
    event = await ship_and_commit(store, args.stagings, [args.root])
    return event, time.monotonic() - began


async def assert_whole(store: S3Store, args: Set, event: CheckpointCommitted, tmp: Path) -> None:
    got = await mf.download(store, JOB, args.checkpoint_id, tmp / f"restore-{args.checkpoint_id}",
                            expected_sha256=event.manifest_sha256)
    assert got.step == args.step and len(got.shards) == 3


async def assert_gone(store: S3Store, args: Set) -> None:
    assert await store.list(mf.prefix(JOB, args.checkpoint_id)) == [], "a failed checkpoint left objects"
    assert await store.multipart_uploads() == [], "a failed checkpoint left a multipart upload open"


async def test_transient_faults_are_retried_and_the_checkpoint_commits(s3: S3Store, proxy: FaultProxy,
                                                                       tmp_path: Path) -> None:
    for kind in ("500", "503", "reset", "stall", "500"):
        proxy.fail(kind, match=put)
    args = staged(tmp_path, 10)
    event, seconds = await committed(s3, args)
    assert isinstance(event, CheckpointCommitted), event
    assert {k: proxy.seen[f"fault:{k}"] for k in ("500", "503", "reset", "stall")} == \
        {"500": 2, "503": 1, "reset": 1, "stall": 1}
    proxy.fail("reset", match=lambda m, p: m == "GET")  # and a restore retries a dropped read
    await assert_whole(s3, args, event, tmp_path)
    assert seconds < HELD_AT_MOST_S, f"{seconds:.1f}s"


@pytest.mark.parametrize(("kind", "says"), [("503", "SlowDown"), ("500", "InternalError"), ("reset", "upload failed")])
async def test_persistent_faults_fail_the_checkpoint_and_keep_the_previous(
        s3: S3Store, proxy: FaultProxy, tmp_path: Path, kind: str, says: str) -> None:
    good = staged(tmp_path, 10)
    first, _ = await committed(s3, good)
    assert isinstance(first, CheckpointCommitted)
    proxy.fail(kind, times=None, match=shard_put)
    bad = staged(tmp_path, 20)
    event, seconds = await committed(s3, bad)
    assert isinstance(event, CheckpointFailed), event
    assert says in event.reason and bad.checkpoint_id in event.reason, event.reason
    assert seconds < HELD_AT_MOST_S, f"held the service {seconds:.1f}s"
    proxy.clear()
    await assert_gone(s3, bad)
    await assert_whole(s3, good, first, tmp_path)  # the previous checkpoint is still the newest, whole


async def test_an_upload_started_by_a_request_whose_answer_was_lost_is_aborted(
        s3: S3Store, proxy: FaultProxy, tmp_path: Path) -> None:
    """The endpoint starts a multipart upload but its answer never arrives: the retry starts a second one, and the
    first, whose id the store never learnt, must not stay open."""
    proxy.fail("lost", match=lambda method, path: method == "POST" and "uploads" in path)
    args = staged(tmp_path, 10)
    event, _ = await committed(s3, args)
    assert isinstance(event, CheckpointCommitted), event
    assert proxy.seen["fault:lost"] == 1
    assert await s3.multipart_uploads() == []
    await assert_whole(s3, args, event, tmp_path)


async def test_a_stalled_endpoint_fails_in_bounded_time(s3: S3Store, proxy: FaultProxy, tmp_path: Path) -> None:
    proxy.fail("stall", times=None, match=shard_put)
    event, seconds = await committed(s3, staged(tmp_path, 10))
    assert isinstance(event, CheckpointFailed), event
    assert "Timeout" in event.reason or "timeout" in event.reason, event.reason
    assert seconds < HELD_AT_MOST_S, f"held the service {seconds:.1f}s"
    proxy.clear()
    assert await s3.list(mf.prefix(JOB, "step000000010-a0")) == [] and await s3.multipart_uploads() == []


async def test_a_manifest_that_cannot_be_written_leaves_no_checkpoint(s3: S3Store, proxy: FaultProxy,
                                                                     tmp_path: Path) -> None:
    proxy.fail("500", times=None, match=manifest_put)
    args = staged(tmp_path, 10)
    event, _ = await committed(s3, args)
    assert isinstance(event, CheckpointFailed) and "InternalError" in event.reason, event
    proxy.clear()
    assert not await s3.exists(mf.manifest_key(JOB, args.checkpoint_id))
    await assert_gone(s3, args)


async def test_a_restore_through_a_failing_endpoint_is_refused_and_leaves_nothing(
        s3: S3Store, proxy: FaultProxy, tmp_path: Path) -> None:
    args = staged(tmp_path, 10)
    event, _ = await committed(s3, args)
    assert isinstance(event, CheckpointCommitted)
    proxy.fail("503", times=None, match=lambda m, p: m == "GET" and mf.MANIFEST not in p)
    dest = tmp_path / "restore"
    began = time.monotonic()
    with pytest.raises(Exception, match=r"SlowDown|Slow Down|503"):
        await mf.download(s3, JOB, args.checkpoint_id, dest, expected_sha256=event.manifest_sha256)
    assert time.monotonic() - began < HELD_AT_MOST_S
    assert not dest.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".restore")], \
        "a refused restore left files behind"
