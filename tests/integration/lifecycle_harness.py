"""The whole platform on a real broker for lifecycle tests and benches: every service as
`python -m flightdeck.services NAME` (scheduler, resources, checkpoints, health, resharder) and one node agent, with
the checkpoint service and the agent sharing an object store named by FLIGHTDECK_OBJECTS: a local folder,
or a bucket on the moto S3 server (tests/integration/s3_fixture.py).

    from tests.integration.lifecycle_harness import objects, platform   # the fixtures
    async def test_x(platform: Platform) -> None: ...                    # runs once per object store

`Platform` is engineer G's `Cluster` (test_lifecycle_services.py: recorder, waits, submit, logs) with the
object store and the full set of services; `stop()` and `service()` take one service down and up again.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.spec import JobSpec
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.open import OBJECTS_ENV, open_store
from flightdeck.services.shell.objects.store import ObjectStore
from flightdeck.services.tools import codeship
from tests.integration.s3_fixture import MotoS3
from tests.integration.test_lifecycle_services import ROOT, Cluster

SERVICES = ("scheduler", "resources", "checkpoints", "health", "resharder", "archiver")


@dataclass(frozen=True)
class Objects:
    """An object store as the services and agent are told of it (URL and environment), and opened here."""

    url: str
    endpoint: str | None = None  # S3 only; handed to the processes as AWS_ENDPOINT_URL_S3

    @property
    def env(self) -> dict[str, str]:
        extra = {OBJECTS_ENV: self.url}
        if self.endpoint:
            extra["AWS_ENDPOINT_URL_S3"] = self.endpoint
        return extra

    def open(self) -> AbstractAsyncContextManager[ObjectStore]:
        return open_store(self.url, endpoint_url=self.endpoint)

    async def manifests(self, job_id: str) -> list[str]:
        """Checkpoint ids with a MANIFEST.json in the store: the committed checkpoints that exist."""
        async with self.open() as store:
            keys = await store.list(f"checkpoints/{job_id}/")
        return sorted(k.split("/")[-2] for k in keys if k.endswith("/" + mf.MANIFEST))

    async def keys(self, job_id: str, checkpoint_id: str = "") -> list[str]:
        async with self.open() as store:
            return sorted(await store.list(mf.prefix(job_id, checkpoint_id) if checkpoint_id
                                           else f"checkpoints/{job_id}/"))

    async def manifest_bytes(self, job_id: str, checkpoint_id: str) -> bytes:
        async with self.open() as store:
            return await store.get_bytes(mf.manifest_key(job_id, checkpoint_id))

    async def ship(self, spec: JobSpec, folder: Path) -> JobSpec:
        """`spec` with `folder` shipped as its code, as `flightdeck submit` does (services/tools/codeship.py)."""
        async with self.open() as store:
            return await codeship.ship(spec, folder, store)


@dataclass
class Platform(Cluster):
    objects: Objects = field(default_factory=lambda: Objects(""))

    def process_env(self, name: str) -> dict[str, str]:
        """The environment process `name` runs with (a subclass adds, e.g., its broker credentials)."""
        # nothing but the broker and the object store is shared: each agent stores its own ranks' stagings
        return {**os.environ, "PYTHONPATH": str(ROOT), "FLIGHTDECK_LOG_LEVEL": "INFO", **self.objects.env}

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = self.process_env(name)
        with open(self.root / f"{name}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def agent(self, node: str = "n1", *extra: str) -> subprocess.Popen[bytes]:
        return super().agent(node, "--objects", self.objects.url, *extra)

    def start_all(self, services: tuple[str, ...] = SERVICES) -> None:
        for name in services:
            self.service(name)
        self.agent()

    async def eventually(self, check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
        """`until` for a check that has to await (e.g. list the object store)."""
        deadline = time.monotonic() + within
        while not await check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {within}s waiting for {what}\n{self.logs()}")
            await asyncio.sleep(0.2)

    def stop(self, name: str, timeout_s: float = 30.0) -> int:
        """SIGTERM one process (a service drains its input in hand) and wait for it; its exit code."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()


async def open_platform(url: str, root: Path, objects: Objects) -> Platform:
    """A platform with its recorder running and nothing started yet; `close()` stops whatever was."""
    store = await JetStreamStore.connect(url, name="lifecycle-harness")
    p = Platform(url, root, store, objects=objects)
    await p.record()
    return p


@pytest.fixture(params=["local", "s3"])
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Objects]:
    """Each object store in turn: a local folder, then a bucket on the moto S3 server."""
    if request.param == "local":
        yield Objects(str(tmp_path / "objects"))
        return
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    yield Objects(f"s3://{s3.bucket}", endpoint=s3.endpoint)


@pytest.fixture
def local_objects(tmp_path: Path) -> Objects:
    return Objects(str(tmp_path / "objects"))


@pytest.fixture
async def platform(nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects) -> AsyncIterator[Platform]:
    """Every service and one agent (2 CPU slots, node n1) on `objects`; all stopped at the end."""
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        p.start_all()
        await p.ready()
        yield p
    finally:
        await p.close()
