"""The S3 store against moto's server over HTTP: multipart, aborts, retries through a throttling
proxy, and the sweeper for uploads a killed process left behind."""

import asyncio
import hashlib
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aioboto3
import aiohttp
import botocore.exceptions
import pytest
from aiohttp import web

from flightdeck.services.checkpoints import sweeper
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.open import open_store
from flightdeck.services.shell.objects.retry import RetryPolicy, is_retryable
from flightdeck.services.shell.objects.s3 import MIN_PART_SIZE, S3Store
from tests.integration.s3_fixture import MotoS3, moto_s3

__all__ = ["moto_s3"]
pytestmark = pytest.mark.timeout(90)
MiB = 1 << 20


def fast_retry(attempts: int = 8) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, base_s=0.005, cap_s=0.05)


async def raw_uploads(s3: MotoS3) -> list[dict]:
    async with aioboto3.Session().client("s3", endpoint_url=s3.endpoint) as c:
        return (await c.list_multipart_uploads(Bucket=s3.bucket)).get("Uploads", [])


async def test_large_file_goes_up_in_parts(moto_s3: MotoS3, tmp_path: Path) -> None:
    data = os.urandom(3 * MIN_PART_SIZE + 1234)
    (tmp_path / "big").write_bytes(data)
    async with S3Store.open(moto_s3.bucket, endpoint_url=moto_s3.endpoint, part_size=MIN_PART_SIZE,
                            max_concurrency=2, root="fleet-a/") as st:
        assert await st.put_file("ck/big", tmp_path / "big") == (len(data), hashlib.sha256(data).hexdigest())
        assert st.uri("ck/big") == f"s3://{moto_s3.bucket}/fleet-a/ck/big"
        assert await st.list("ck/") == ["ck/big"]
        head = await st.client.head_object(Bucket=moto_s3.bucket, Key="fleet-a/ck/big")
    assert head["ETag"].strip('"').endswith("-4")  # a multipart object of four parts
    assert await raw_uploads(moto_s3) == []


async def wait_for_upload(s3: MotoS3) -> None:
    deadline = time.monotonic() + 20
    while not await raw_uploads(s3):
        assert time.monotonic() < deadline, "the multipart upload never started"
        await asyncio.sleep(0.01)


async def test_a_failure_mid_upload_aborts_the_multipart_upload(moto_s3: MotoS3, tmp_path: Path) -> None:
    src = tmp_path / "shrinking"
    src.write_bytes(os.urandom(8 * MIN_PART_SIZE))
    async with S3Store.open(moto_s3.bucket, endpoint_url=moto_s3.endpoint, part_size=MIN_PART_SIZE,
                            max_concurrency=1, retry=fast_retry()) as st:
        upload = asyncio.create_task(st.put_file("ck/shrinking", src))
        await wait_for_upload(moto_s3)
        os.truncate(src, MIN_PART_SIZE)  # what a rank rewriting its staging would do
        with pytest.raises(OSError, match="shrank"):
            await upload
        assert not await st.exists("ck/shrinking")
    assert await raw_uploads(moto_s3) == []


async def test_cancelling_an_upload_aborts_it(moto_s3: MotoS3, tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(os.urandom(8 * MIN_PART_SIZE))
    async with S3Store.open(moto_s3.bucket, endpoint_url=moto_s3.endpoint, part_size=MIN_PART_SIZE,
                            max_concurrency=1) as st:
        upload = asyncio.create_task(st.put_file("ck/big", tmp_path / "big"))
        await wait_for_upload(moto_s3)
        assert await sweeper.sweep(st, older_than_s=0) == []  # the store's own upload in progress is spared
        upload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await upload
    assert await raw_uploads(moto_s3) == []


class ThrottlingProxy:
    """An HTTP proxy in front of moto that answers chosen requests with an error, like a busy S3."""

    def __init__(self, upstream: str, fail: "callable[[int], int | None]") -> None:  # type: ignore[valid-type]
        self.upstream = upstream
        self.fail = fail  # request number -> HTTP status to fail with, or None to forward
        self.count = 0
        self.failed = 0
        self.parts_in_flight = 0
        self.peak_parts_in_flight = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.count += 1
        body = await request.read()
        status = self.fail(self.count)
        if status is not None:
            self.failed += 1
            code = {503: "SlowDown", 429: "TooManyRequests", 500: "InternalError"}[status]
            xml = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>busy</Message></Error>"
            return web.Response(status=status, body=xml.encode(), content_type="application/xml")
        is_part = "partNumber" in request.query
        self.parts_in_flight += is_part
        self.peak_parts_in_flight = max(self.peak_parts_in_flight, self.parts_in_flight)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with aiohttp.ClientSession() as session, session.request(
                    request.method, self.upstream + request.path_qs, headers=headers, data=body) as resp:
                payload = await resp.read()
                out = {k: v for k, v in resp.headers.items()
                       if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")}
                return web.Response(status=resp.status, body=payload, headers=out)
        finally:
            self.parts_in_flight -= is_part


async def start_proxy(proxy: ThrottlingProxy) -> AsyncIterator[str]:
    app = web.Application(client_max_size=64 * MiB)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [503, 429, 500])
async def test_throttling_and_server_errors_are_retried(moto_s3: MotoS3, tmp_path: Path, status: int) -> None:
    data = os.urandom(2 * MIN_PART_SIZE + 99)
    (tmp_path / "f").write_bytes(data)
    proxy = ThrottlingProxy(moto_s3.endpoint, lambda n: status if n % 2 == 1 else None)  # every other request
    async for endpoint in start_proxy(proxy):
        async with S3Store.open(moto_s3.bucket, endpoint_url=endpoint, part_size=MIN_PART_SIZE,
                                retry=fast_retry()) as st:
            assert await st.put_file("ck/f", tmp_path / "f") == (len(data), hashlib.sha256(data).hexdigest())
            await st.put_bytes("ck/MANIFEST.json", b"{}", if_none_match=True)
            assert await st.get_bytes("ck/MANIFEST.json") == b"{}"
    assert proxy.failed >= 4 and proxy.count - proxy.failed >= 7  # 7 calls succeeded, among as many failures
    assert await raw_uploads(moto_s3) == []


async def test_parts_in_flight_are_bounded_across_files(moto_s3: MotoS3, tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(os.urandom(3 * MIN_PART_SIZE))
    proxy = ThrottlingProxy(moto_s3.endpoint, lambda n: None)
    async for endpoint in start_proxy(proxy):
        async with S3Store.open(moto_s3.bucket, endpoint_url=endpoint, part_size=MIN_PART_SIZE,
                                max_concurrency=2) as st:
            await asyncio.gather(*(st.put_file(f"ck/{n}", tmp_path / n) for n in ("a", "b", "c")))
            assert await st.list("ck/") == ["ck/a", "ck/b", "ck/c"]
    assert proxy.peak_parts_in_flight == 2


async def test_retries_give_up_after_the_last_attempt(moto_s3: MotoS3) -> None:
    proxy = ThrottlingProxy(moto_s3.endpoint, lambda n: 503)
    async for endpoint in start_proxy(proxy):
        async with S3Store.open(moto_s3.bucket, endpoint_url=endpoint, retry=fast_retry(attempts=4)) as st:
            with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
                await st.put_bytes("k", b"x")
    assert proxy.count == 4


async def test_sweeper_aborts_uploads_left_by_a_killed_process(moto_s3: MotoS3) -> None:
    async with aioboto3.Session().client("s3", endpoint_url=moto_s3.endpoint) as c:  # the process that "dies"
        up = await c.create_multipart_upload(Bucket=moto_s3.bucket, Key="checkpoints/j/c/__0_0.distcp")
        await c.upload_part(Bucket=moto_s3.bucket, Key="checkpoints/j/c/__0_0.distcp", UploadId=up["UploadId"],
                            PartNumber=1, Body=b"x" * MIN_PART_SIZE)
    async with S3Store.open(moto_s3.bucket, endpoint_url=moto_s3.endpoint) as st:
        [listed] = await st.multipart_uploads()
        initiated = listed["Initiated"].timestamp()  # moto reports a fixed 2010 date, so age is taken from it
        assert await sweeper.sweep(st, older_than_s=3600, now=initiated + 60) == []  # young: maybe in progress
        assert len(await raw_uploads(moto_s3)) == 1
        swept = await sweeper.sweep(st, older_than_s=3600, now=initiated + 7200)
    assert [(s.key, s.upload_id) for s in swept] == [("checkpoints/j/c/__0_0.distcp", up["UploadId"])]
    assert await raw_uploads(moto_s3) == []


async def test_sweeper_removes_stale_local_temp_files(tmp_path: Path) -> None:
    st = LocalStore(tmp_path / "objects")
    (st.tmp_dir / "left-by-a-crash").write_bytes(b"partial")
    assert await sweeper.sweep(st, older_than_s=3600) == []
    swept = await sweeper.sweep(st, older_than_s=3600, now=time.time() + 7200)
    assert [s.key for s in swept] == ["left-by-a-crash"] and list(st.tmp_dir.iterdir()) == []


def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError({"Error": {"Code": code, "Message": "m"},
                                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_which_errors_are_retried() -> None:
    for code, status in [("SlowDown", 503), ("TooManyRequests", 429), ("InternalError", 500), ("", 502),
                         ("RequestTimeout", 400), ("ConditionalRequestConflict", 409)]:
        assert is_retryable(client_error(code, status)), code
    for code, status in [("PreconditionFailed", 412), ("NoSuchKey", 404), ("AccessDenied", 403),
                         ("InvalidPart", 400)]:
        assert not is_retryable(client_error(code, status)), code
    assert is_retryable(botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"))
    assert is_retryable(ConnectionResetError()) and not is_retryable(ValueError())


async def test_backoff_is_exponential_with_full_jitter_and_capped() -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    policy = RetryPolicy(attempts=6, base_s=0.1, cap_s=0.5, rng=random.Random(7), sleep=sleep)
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 6:
            raise client_error("SlowDown", 503)
        return "ok"

    assert await policy.call("put_object", flaky) == "ok"
    assert calls == 6 and len(slept) == 5
    assert all(0 <= s <= min(0.5, 0.1 * 2**i) for i, s in enumerate(slept))
    assert len(set(slept)) == 5  # jittered, not a fixed schedule


async def test_open_store_by_url(moto_s3: MotoS3, tmp_path: Path) -> None:
    async with open_store(f"s3://{moto_s3.bucket}/team/a", endpoint_url=moto_s3.endpoint) as st:
        assert isinstance(st, S3Store) and st.uri("k") == f"s3://{moto_s3.bucket}/team/a/k"
        await st.put_bytes("k", b"v")
        assert await st.get_bytes("k") == b"v"
    async with open_store((tmp_path / "objs").as_uri()) as local:
        assert isinstance(local, LocalStore) and local.root == (tmp_path / "objs").resolve()
    async with open_store(str(tmp_path / "plain")) as local:
        assert isinstance(local, LocalStore)
    with pytest.raises(ValueError, match="unsupported"):
        async with open_store("ftp://x"):
            pass
