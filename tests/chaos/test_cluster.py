"""A job on a three-server broker cluster (infra/nats/cluster.conf, services.shell.broker.start_cluster): every process
is given all three URLs, the streams are created with three replicas, and under the running job the server leading
FD_TELEMETRY is SIGKILLed (and started again), then the one leading FD_CONTROL at that moment. Each kill leaves a
quorum of two, so the job completes with nothing lost, the cores replay to the recorded decisions, and no decision
is taken twice; and in one attempt: with the drills' 2 s heartbeat deadline no live rank is found lost while a new
leader takes over (a health tick names the telemetry stored by its time, services/shell/tap.py)."""

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.jsreader import is_unavailable
from flightdeck.events.streams import REPLICAS_ENV, ensure_streams, server_list
from flightdeck.services.shell import broker as broker_mod
from tests.chaos.checks import check, record
from tests.chaos.harness import chaos_spec, ended, progress, step_reached
from tests.e2e.drill_harness import export, start_drill, wait_lineage
from tests.integration.lifecycle_harness import Platform

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
STEPS = 130


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[broker_mod.BrokerCluster]:
    c = broker_mod.start_cluster(tmp_path / "nats")
    try:
        yield c
    finally:
        c.stop()


async def leader(store: JetStreamStore, stream: str) -> int:
    """The index (in the cluster's members) of the server leading `stream` now, once one is elected."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(Exception):  # no leader yet, or the server asked is the one just killed
            info = await store.js.stream_info(stream)
            if info.cluster and info.cluster.leader:
                return int(info.cluster.leader.removeprefix("fd-")) - 1
        if time.monotonic() > deadline:
            raise AssertionError(f"no leader for {stream} within 30 s")
        await asyncio.sleep(0.2)


async def kill_member(cluster: broker_mod.BrokerCluster, index: int) -> None:
    member = cluster.members[index]
    member.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(member.proc.wait, 10)


@pytest.mark.timeout(60)
async def test_streams_take_three_replicas_on_a_cluster_and_an_automatic_choice_never_lowers_them(
        cluster: broker_mod.BrokerCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    async def provision(url: str) -> tuple[dict[str, str], dict[str, int]]:
        """What a process starting now does to the streams (retried, as the services retry, while a stream has
        no leader yet), and the replicas they have then."""
        store = await JetStreamStore.connect(url, provision=False)
        try:
            for _ in range(40):
                try:
                    done = await ensure_streams(store.js)
                    return done, {s: (await store.js.stream_info(s)).config.num_replicas or 1
                                  for s in subjects.STREAM_SUBJECTS}
                except Exception as exc:  # a timeout, or 503 "JetStream system temporarily unavailable" after a kill
                    if not is_unavailable(exc):
                        raise
                await asyncio.sleep(0.5)
            raise AssertionError(f"no stream leaders at {url} within 20 s")
        finally:
            await store.close()

    monkeypatch.delenv(REPLICAS_ENV, raising=False)
    everything = dict.fromkeys(subjects.STREAM_SUBJECTS, 3)
    assert await provision(cluster.members[0].url) == (dict.fromkeys(subjects.STREAM_SUBJECTS, "created"), everything)
    await kill_member(cluster, 2)  # what a process starting now sees: a cluster of two
    assert await provision(cluster.members[1].url) == (dict.fromkeys(subjects.STREAM_SUBJECTS, "unchanged"), everything)
    monkeypatch.setenv(REPLICAS_ENV, "1")  # an explicit setting is obeyed, down as well as up
    assert (await provision(cluster.members[1].url))[1] == dict.fromkeys(subjects.STREAM_SUBJECTS, 1)


def test_a_broker_url_may_name_several_servers() -> None:
    assert server_list("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    with pytest.raises(ValueError, match="no NATS server"):
        server_list(" , ")


@pytest.mark.timeout(240)
async def test_a_job_survives_losing_a_server_then_a_stream_leader(cluster: broker_mod.BrokerCluster,
                                                                   tmp_path: Path) -> None:
    started, job = time.monotonic(), "chaos-cluster-000001"
    p: Platform = await start_drill(cluster.url, tmp_path)
    try:
        for stream in subjects.STREAM_SUBJECTS:
            assert (await p.store.js.stream_info(stream)).config.num_replicas == 3, stream
        p.agent("n1", "--grace-s", "2")
        await p.ready("n1")
        spec = chaos_spec("chaos-cluster", STEPS)
        assert spec.policy.heartbeat_interval_s * spec.policy.heartbeat_misses == 2.0  # the drills' deadline
        await p.submit(spec, job)

        await step_reached(p, job, 0, 3)
        first = await leader(p.store, subjects.TELEMETRY)
        await kill_member(cluster, first)
        await progress(p, job, 0, 5)  # two servers carry on: a new leader, telemetry flows
        await asyncio.to_thread(cluster.restart, first)  # back and current before the next kill keeps a quorum
        second = await leader(p.store, subjects.CONTROL)
        await kill_member(cluster, second)
        faults = [f"SIGKILL fd-{first + 1} (FD_TELEMETRY leader), restart",
                  f"SIGKILL fd-{second + 1} (FD_CONTROL leader)"]

        await p.until(lambda: ended(p, job), 150, "the job to end", job)
        outcome = await check(p.store, job, steps=STEPS, drill="cluster", faults=faults,
                              seconds=time.monotonic() - started)
        record(outcome)
        assert await wait_lineage(p, job, STEPS) == []
        assert outcome.held, outcome
        assert outcome.attempts == 1 and outcome.findings == [], outcome  # losing a server costs no restart
        assert await leader(p.store, subjects.CONTROL) != second  # a new leader took over
    finally:
        try:
            await export(p, job, tmp_path / f"{job}.history.jsonl")
        finally:
            await p.close()
