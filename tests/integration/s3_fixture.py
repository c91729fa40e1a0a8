"""A real S3 endpoint for tests: moto's server over HTTP on a free port, with a fresh bucket.

moto's in-process mocks do not reach aioboto3, so tests talk HTTP to `ThreadedMotoServer`.
Import the fixtures into a test module: `from tests.integration.s3_fixture import moto_s3, store`
(`store` runs a test once per object store: local folder, then S3).
Credentials go through the environment, the same standard chain production uses.
"""

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.retry import RetryPolicy
from flightdeck.services.shell.objects.s3 import MIN_PART_SIZE, S3Store
from flightdeck.services.shell.objects.store import ObjectStore


@dataclass(frozen=True)
class MotoS3:
    endpoint: str
    bucket: str
    region: str = "us-east-1"


@contextmanager
def moto_server(monkeypatch: pytest.MonkeyPatch, ip_address: str = "127.0.0.1") -> Iterator[MotoS3]:
    """moto's S3 over HTTP on `ip_address`, with one fresh bucket; AWS credentials for it in the environment."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    server = ThreadedMotoServer(ip_address=ip_address, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto keeps one backend per process, so each test gets its own bucket rather than a reset
    bucket = f"fd-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    try:
        yield MotoS3(endpoint=endpoint, bucket=bucket)
    finally:
        server.stop()


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoS3]:
    with moto_server(monkeypatch) as s3:
        yield s3


@pytest.fixture(params=["local", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    """Each object store in turn: the local folder, then S3 (moto over HTTP) with small parts."""
    if request.param == "local":
        yield LocalStore(tmp_path / "objects")
        return
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    async with S3Store.open(s3.bucket, endpoint_url=s3.endpoint, part_size=MIN_PART_SIZE, max_concurrency=4,
                            retry=RetryPolicy(base_s=0.01)) as st:
        yield st
