"""A rank's command inbox against a real nats-server: order, only what came after it started, and broker restarts."""

import asyncio
import threading
import time
import uuid

import msgspec
import pytest

from events.base import Event, JobEvent
from events.commands import CheckpointRequested, PauseRequested, ResumeRequested, StopRequested
from events.history import append_to_job
from events.jetstream import JetStreamStore
from events.job import JobQueued
from services.shell import broker as broker_mod
from tests.conftest import ensure_streams_at, restart_broker
from trainer.commands import CommandInbox

JOB = "job-c"



def _append(url: str, *events: JobEvent) -> None:
    """Append to the job's history as the services do: numbered, so every reader admits them."""
    async def go() -> None:
        store = await JetStreamStore.connect(url, name="commands-test")
        try:
            for e in events:
                await append_to_job(store, msgspec.structs.replace(e, event_id=e.event_id or uuid.uuid4().hex))
        finally:
            await store.close()

    asyncio.run(go())


def _collect(inbox: CommandInbox, n: int, timeout: float) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {got} of {n} commands in time"
        got += inbox.poll()
        time.sleep(0.02)
    return got


def _reasons(events: list[Event]) -> list[tuple[str, str]]:
    return [(type(e).__name__, getattr(e, "reason", "")) for e in events]


@pytest.mark.timeout(180)
def test_commands_arrive_in_order_and_earlier_ones_are_ignored(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    _append(nats_server.url, StopRequested(job_id=JOB, reason="a previous attempt's"))
    inbox = CommandInbox(nats_server.url, JOB, 0, 1)
    inbox.start()
    try:
        _append(nats_server.url,
                PauseRequested(job_id=JOB, reason="1"),
                JobQueued(job_id=JOB, priority=0),  # not a command: not on the inbox's subjects
                CheckpointRequested(job_id=JOB, reason="2"),
                StopRequested(job_id="other-job", reason="someone else's"),
                ResumeRequested(job_id=JOB, reason="3"),
                StopRequested(job_id=JOB, checkpoint=False, reason="4"))
        got = _collect(inbox, 4, 60)
        assert _reasons(got) == [("PauseRequested", "1"), ("CheckpointRequested", "2"),
                                 ("ResumeRequested", "3"), ("StopRequested", "4")]
        time.sleep(0.3)
        assert inbox.poll() == []
    finally:
        inbox.close()
    assert not any(t.name.startswith("commands-") for t in threading.enumerate())


@pytest.mark.timeout(180)
def test_inbox_keeps_working_across_broker_restarts(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    _append(nats_server.url, StopRequested(job_id=JOB, reason="old"))
    inbox = CommandInbox(nats_server.url, JOB, 0, 0)
    inbox.start()
    broker = nats_server
    try:
        time.sleep(0.5)
        # A restart before the first command: the new consumer must still start after the inbox did,
        # not from the beginning of the history.
        broker = restart_broker(broker)
        _append(broker.url, PauseRequested(job_id=JOB, reason="1"))
        got = _collect(inbox, 1, 60)
        broker = restart_broker(broker)
        _append(broker.url, ResumeRequested(job_id=JOB, reason="2"), CheckpointRequested(job_id=JOB, reason="3"))
        got += _collect(inbox, 2, 60)
        time.sleep(0.5)
        got += inbox.poll()
    finally:
        inbox.close()
        broker.stop()
    assert _reasons(got) == [("PauseRequested", "1"), ("ResumeRequested", "2"), ("CheckpointRequested", "3")]


@pytest.mark.timeout(180)
def test_inbox_started_while_the_broker_is_down_gets_what_came_after_start(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    _append(nats_server.url, StopRequested(job_id=JOB, reason="old"))
    nats_server.stop()
    inbox = CommandInbox(nats_server.url, JOB, 0, 0)
    t0 = time.perf_counter()
    inbox.start()
    # Waiting for the broker would mean until the restart below, i.e. forever from here: a hang guard, not a speed.
    assert time.perf_counter() - t0 < 10.0
    time.sleep(0.2)
    broker = broker_mod.start(nats_server.store_dir, nats_server.port)
    try:
        _append(broker.url, PauseRequested(job_id=JOB, reason="1"))
        got = _collect(inbox, 1, 60)
        time.sleep(0.3)
        got += inbox.poll()
    finally:
        inbox.close()
        broker.stop()
    assert _reasons(got) == [("PauseRequested", "1")]


def test_no_url_makes_the_inbox_a_no_op() -> None:
    before = threading.active_count()
    inbox = CommandInbox(None, JOB, 0, 0)
    inbox.start()
    assert inbox.poll() == [] and threading.active_count() == before
    inbox.close()
