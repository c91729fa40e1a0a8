"""Shared fixtures: a real nats-server with JetStream on a free port and a temp store."""

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from flightdeck.events.streams import ensure_streams
from flightdeck.services.agent.snapshots import default_root
from flightdeck.services.shell import broker as broker_mod

# Node agents the tests start keep the product's default of warm standby ranks (one per slot and one more), forked
# from the node's fork server: torch is imported once per agent, not once per rank and self-check, which was most
# of the suite's CPU on a 2-core box. FLIGHTDECK_STANDBY=0 runs every test with cold ranks instead.

# Where `flightdeck up` notes its data dir for `down --nats`: the tests' ups go in an index of their own, not the
# user's (~/.local/state/flightdeck/up).
os.environ.setdefault("FLIGHTDECK_UP_INDEX", tempfile.mkdtemp(prefix="flightdeck-up-index-"))

# `flightdeck up` serves /metrics on port 8321 unless told otherwise; the suite runs many ups at once, so theirs
# serve none unless a test asks (`--ui-port`). The demo picks a free port when 8321 is taken.
os.environ.setdefault("FLIGHTDECK_UI_PORT", "0")

# A job's MASTER_PORT is a function of its id and attempt (services/resources/core.py), so two tests on different
# xdist workers that run the same job id at once would have their ranks 0 listen on one port of this host
# (EADDRINUSE: the ranks exit 1). Each worker's platforms take ports from a range of their own, below the
# ephemeral ports (32768 and up) the broker and clients are given. Set, not defaulted, in a worker: the xdist
# controller imports this file first and its environment (with gw0's range) is what every worker inherits.
if "PYTEST_XDIST_WORKER" in os.environ:
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0)
    os.environ["FLIGHTDECK_MASTER_PORT_BASE"] = str(20_000 + 1_000 * (_worker % 12))
else:
    os.environ.setdefault("FLIGHTDECK_MASTER_PORT_BASE", "20000")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[broker_mod.Broker]:
    """A fresh nats-server for one test. Restart it with `restart_broker(b)`."""
    b = broker_mod.start(tmp_path / "nats")
    yield b
    b.stop()


def restart_broker(b: broker_mod.Broker) -> broker_mod.Broker:
    """Stop and start the same server (same port, same store): what a broker restart looks like."""
    b.stop()
    return broker_mod.start(b.store_dir, b.port)


def ensure_streams_at(url: str) -> None:
    """Provision the three streams on the server at `url`, as every service does at start."""

    async def go() -> None:
        nc = await nats.connect(url)
        try:
            await ensure_streams(nc.jetstream())
        finally:
            await nc.close()

    asyncio.run(go())


SHM = Path("/dev/shm")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The node agents the tests start keep their ranks' snapshots in /dev/shm (services/agent/snapshots.py), which
    is memory: an agent killed mid-job never lets go of them. Once every worker is done (the controller, or the one
    process without xdist), remove the snapshot roots of this session's agents (12 GB had piled up here): a root is
    named after its agent's data dir (snapshots.default_root), which lies under this session's temporary folder.
    Another session's roots are left alone: removing every root made since this one started (as this once did)
    pulled the snapshots from under a concurrent session's running drills."""
    if hasattr(session.config, "workerinput") or not SHM.is_dir():
        return
    base = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    ours = {default_root(Path(folder), "x").name.rsplit("-", 1)[1] for folder, _, _ in _walk(base, depth=5)}
    for root in SHM.glob("flightdeck-*"):
        if root.name.rsplit("-", 1)[1] in ours:
            shutil.rmtree(root, ignore_errors=True)


def _walk(top: Path, depth: int) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk to `depth` folders below `top`."""
    for folder, dirs, files in os.walk(top):
        if len(Path(folder).relative_to(top).parts) >= depth:
            dirs.clear()
        yield folder, dirs, files
