"""Shared fixtures: a real nats-server with JetStream on a free port and a temp store."""

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from events.streams import ensure_streams
from services.shell import broker as broker_mod

STANDBY_ENV = "FLIGHTDECK_STANDBY"  # services.agent.main.STANDBY_ENV (not imported: it pulls in the agent)

# Node agents the tests start (as processes, which inherit this, or in-process) keep no warm standby ranks unless a
# test asks for them (`--standby N`, or this variable in the agent's environment): each standby imports torch, about
# 10 CPU-seconds on a 2-core box at every start and refill, which most tests never use and all of them wait behind.
# Tests about standbys or restart speed (test_standby.py, the demo) ask explicitly; set it yourself to run every
# test with standbys.
os.environ.setdefault(STANDBY_ENV, "0")

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
