"""A rank's link to its node agent (trainer/link.py to services/agent/links.py, both real, over a real socket to a
real nats-server): events up in order on their subjects, in the agent's custody across a broker outage and past
the rank's exit; commands, plans and a rollback's readiness down; what the agent refuses; an agent that vanishes."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.backlog import Backlog
from flightdeck.events.base import Event, RankEvent
from flightdeck.events.checkpoint import CheckpointStaged, DataPosition
from flightdeck.events.commands import CheckpointRequested, StopRequested
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.ranklink import Hello
from flightdeck.events.training import FaultInjected, Heartbeat, RankFault, RankStarted, StepCompleted
from flightdeck.services.shell import broker as broker_mod
from flightdeck.trainer.link import AgentLink, AgentUnreachable, Offline
from tests.conftest import ensure_streams_at, restart_broker
from tests.trainer.linkhost import JOB, NODE, LinkHost
from tests.trainer.linkhost import read_telemetry as _read

pytestmark = pytest.mark.timeout(120)
TWO = ParallelPlan(world_size=2, dp=2, micro_batches=2)
FOUR = ParallelPlan(world_size=4, dp=2, tp=2)


def _step(i: int, rank: int = 0) -> StepCompleted:
    return StepCompleted(job_id=JOB, rank=rank, node=NODE, step=i, loss=1.0 / (i + 1), grad_norm=1.0, lr=1e-3,
                         tokens_per_s=1e4, step_time_s=0.01)


def _fault(i: int) -> RankFault:
    return RankFault(job_id=JOB, rank=0, node=NODE, kind="exception", error_type="RuntimeError", message=f"boom {i}",
                     step=i)


def _wait(cond: object, timeout: float, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not met in time"
        time.sleep(0.02)


def msgspec_attempt(e: RankEvent, attempt: int) -> RankEvent:
    return msgspec.structs.replace(e, attempt=attempt)


def _command(event: Event) -> bytes:
    return codec.encode(event)


def test_backlog_drops_oldest_droppable_and_keeps_kept_events_in_order() -> None:
    b = Backlog(4)
    for e in (_step(1), _fault(2), _step(3), _step(4), _step(5), _fault(6), _fault(7), _fault(8)):
        b.push(e)
    # steps 1, 3, 4 went (oldest first), step 5 went too once faults alone filled it; faults exceed capacity
    assert b.num_dropped == 4
    assert [(type(e).__name__, e.step) for e in b.take(10)] == [
        ("RankFault", 2), ("RankFault", 6), ("RankFault", 7), ("RankFault", 8)]
    for e in (_step(9), _fault(10), _step(11)):
        b.push(e)
    assert [e.step for e in b.take(10, kept_first=True)] == [10, 9, 11]


def test_events_arrive_in_order_on_their_subjects_with_their_ids(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    with LinkHost(nats_server.url) as host:
        link = host.link(attempt=2)
        sent: list[RankEvent] = [RankStarted(job_id=JOB, rank=0, attempt=2, node=NODE, world_size=1, from_step=0,
                                             device="cpu")]
        sent += [msgspec_attempt(_step(i), 2) for i in range(300)]
        sent += [FaultInjected(job_id=JOB, rank=0, attempt=2, node=NODE, kind="crash", step=300),
                 msgspec_attempt(_fault(300), 2),
                 CheckpointStaged(job_id=JOB, rank=0, attempt=2, node=NODE, step=300, world_size=1, staging_dir="/s",
                                  shards=[], data=DataPosition(next_batch=301), stall_s=0.1, write_s=0.2)]
        for e in sent:
            link.emit(e)
        link.close(timeout=10)
        assert link.num_pending == 0 and link.num_refused == 0
        _wait(lambda: len(_read(nats_server.url, f"fd.tel.{JOB}.0.>")) >= len(sent), 30, "every event stored")
    got = [(s, e) for s, e in _read(nats_server.url, f"fd.tel.{JOB}.0.>") if not isinstance(e, Heartbeat)]
    assert [(type(e), getattr(e, "step", None)) for _, e in got] == [(type(e), getattr(e, "step", None)) for e in sent]
    for subject, e in got:
        assert subject == subjects.telemetry(JOB, 0, type(e).__name__)
        assert len(e.event_id) == 32 and e.producer == "trainer" and e.occurred_at > 0
    assert len({e.event_id for _, e in got}) == len(sent)


def test_the_agent_keeps_a_ranks_events_through_a_broker_outage_and_past_the_ranks_exit(
        nats_server: broker_mod.Broker) -> None:
    """The rank hands its events over and exits while the broker is down; the agent publishes them, each once and
    in order, when the broker is back: a crash's last fault is not lost with the rank."""
    ensure_streams_at(nats_server.url)
    broker = nats_server
    with LinkHost(nats_server.url) as host:
        link = host.link()
        sent: list[RankEvent] = []
        for i in range(100):
            sent.append(_fault(i) if i % 10 == 0 else _step(i))
            link.emit(sent[-1])
        _wait(lambda: link.num_pending == 0, 20, "the agent to take the first events")
        broker.stop()
        for i in range(100, 200):
            sent.append(_fault(i) if i % 10 == 0 else _step(i))
            link.emit(sent[-1])
        link.close(timeout=10)  # the agent took them: the rank is done with them, the broker still away
        assert link.num_pending == 0
        broker = restart_broker(broker)
        try:
            _wait(lambda: len(_read(broker.url, f"fd.tel.{JOB}.0.>")) >= len(sent), 60, "the held events stored")
            got = [e for _, e in _read(broker.url, f"fd.tel.{JOB}.0.>") if not isinstance(e, Heartbeat)]
        finally:
            host.close()
            broker.stop()
    assert [(type(e), e.step) for e in got] == [(type(e), e.step) for e in sent]  # all, once, in order


def test_an_event_that_is_not_the_ranks_own_is_refused_and_never_stored(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    job = "job-refused"

    def step(i: int, rank: int = 1, attempt: int = 0) -> StepCompleted:
        return msgspec.structs.replace(_step(i, rank), job_id=job, attempt=attempt)

    with LinkHost(nats_server.url) as host:
        link = host.link(rank=1, job_id=job)
        link.emit(step(1))
        link.emit(step(2, rank=0))  # another rank's
        link.emit(step(3, attempt=5))  # another attempt's
        link.emit(msgspec.structs.replace(step(4), node="node-b"))  # another node's
        link.emit(RankFault(job_id="other-job", rank=1, node=NODE, kind="exception", error_type="E", message="m",
                            step=5))
        link.close(timeout=10)
        assert link.num_refused == 4
        _wait(lambda: len(_read(nats_server.url, f"fd.tel.{job}.1.StepCompleted")) == 1, 20, "the rank's own step")
    stored = [e for _, e in _read(nats_server.url, f"fd.tel.{job}.>") if not isinstance(e, Heartbeat)]
    assert [(type(e), e.step) for e in stored] == [(StepCompleted, 1)]  # type: ignore[attr-defined]
    assert _read(nats_server.url, "fd.tel.other-job.>") == []


def test_commands_come_down_in_order_including_those_told_before_the_rank_connected(
        nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    early = CheckpointRequested(job_id=JOB, event_id="c1")
    with LinkHost(nats_server.url) as host:
        stop = StopRequested(job_id=JOB, event_id="c0")
        host.call(lambda links: links.command(JOB, 0, _command(stop)))  # attempt 0's
        host.call(lambda links: links.command(JOB, 1, _command(early)))  # told before the rank's link came up
        link = host.link(attempt=1)
        later = [CheckpointRequested(job_id=JOB, event_id=f"c{i}") for i in range(2, 6)]
        for c in later:
            host.call(lambda links, c=c: links.command(JOB, 1, _command(c)))
        host.call(lambda links: links.command(JOB, 1, _command(later[0])))  # the same input folded again: told once
        last = CheckpointRequested(job_id=JOB, event_id="c6")
        host.call(lambda links: links.command(JOB, 1, _command(last)))
        got: list[Event] = []
        _wait(lambda: got.extend(link.poll()) or any(c.event_id == "c6" for c in got), 20, "the last command")
        assert [c.event_id for c in got] == ["c1", "c2", "c3", "c4", "c5", "c6"]


def test_the_plan_is_at_hand_when_known_and_waited_for_when_the_world_changed(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    with LinkHost(nats_server.url) as host:
        host.call(lambda links: links.plan(JOB, FOUR))  # the previous attempt's, another world size
        link = host.link()
        assert link.plan(4, 5.0) == FOUR
        timer = threading.Timer(0.5, lambda: host.call(lambda links: links.plan(JOB, TWO)))
        timer.start()
        assert link.plan(2, 30.0) == TWO  # recorded a moment after the ranks started
        timer.join()
        assert link.plan(8, 0.2) is None  # none of that size: the caller trains plain data parallel


def test_a_rollback_checkpoint_the_agent_could_not_fetch_is_refused_with_its_reason(
        nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    with LinkHost(nats_server.url) as host:
        link = host.link()
        host.call(lambda links: links.rollback_ready(JOB, "ckpt-1", problem="S3 said 404"))
        host.call(lambda links: links.rollback_ready(JOB, "ckpt-2", path="/cache/job-l/ckpt-2"))
        assert link.rollback_ready("ckpt-1", 10.0).problem == "S3 said 404"  # type: ignore[union-attr]
        assert link.rollback_ready("ckpt-2", 10.0).path == "/cache/job-l/ckpt-2"  # type: ignore[union-attr]
        assert link.rollback_ready("ckpt-3", 0.1) is None


def test_a_process_the_agent_did_not_start_as_that_rank_is_refused(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)

    async def only_rank_0(hello: Hello, pid: int) -> bool:
        return hello.rank == 0

    with LinkHost(nats_server.url, admit=only_rank_0) as host:
        assert host.links is not None
        impostor = AgentLink(host.links.address, JOB, 1, 0, NODE)
        with pytest.raises(AgentUnreachable, match="refused"):
            impostor.connect(timeout=10)
        host.link(rank=0)


def test_a_rank_whose_agent_vanishes_knows_at_once(nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    host = LinkHost(nats_server.url).__enter__()
    link = host.link()
    assert not link.gone
    host.close()
    _wait(lambda: link.gone, 10, "the link to read as gone")
    assert link.plan(2, 30.0) is None and link.rollback_ready("x", 30.0) is None  # no waiting on a dead agent
    link.close(timeout=1)
    with pytest.raises(AgentUnreachable):
        AgentLink("@flightdeck-no-agent-here", JOB, 0, 0, NODE).connect(timeout=2)


@pytest.mark.timeout(60)
def test_heartbeats_continue_while_the_step_is_stuck_and_stop_on_close(nats_server: broker_mod.Broker) -> None:
    """Without the agent's heartbeat relay the beats go up the link as Heartbeat events, from the link's thread."""
    ensure_streams_at(nats_server.url)
    with LinkHost(nats_server.url) as host:
        link = host.link(heartbeat_s=0.1)
        link.set_step(41)
        time.sleep(0.05)
        link.set_step(42)
        _wait(lambda: len(_read(nats_server.url, f"fd.tel.{JOB}.0.Heartbeat")) >= 7, 30, "seven heartbeats")
        beats = [e for _, e in _read(nats_server.url, f"fd.tel.{JOB}.0.Heartbeat")]
        assert beats[-1].step == 42 and all(b.interval_s == 0.1 for b in beats)  # type: ignore[attr-defined]
        link.close()
        time.sleep(0.5)
        n = len(_read(nats_server.url, f"fd.tel.{JOB}.0.Heartbeat"))
        time.sleep(0.5)
        assert len(_read(nats_server.url, f"fd.tel.{JOB}.0.Heartbeat")) == n
    assert not any(t.name.startswith("agent-link-") for t in threading.enumerate())


def test_emit_never_blocks_and_the_backlog_is_bounded_while_the_agent_does_not_read(
        nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    with LinkHost(nats_server.url) as host:
        link = host.link()
        host.loop.call_soon_threadsafe(lambda: time.sleep(3.0))  # the agent's loop stalls: nothing is read
        t0 = time.perf_counter()
        for i in range(50_000):
            link.emit(_fault(i) if i % 5000 == 0 else _step(i))
        # a hang guard, far above any load's delay: what emit costs is bench/telemetry_overhead.py's
        assert time.perf_counter() - t0 < 30.0
        link.close(timeout=20)
        assert link.num_refused == 0


def test_no_platform_is_offline_and_starts_no_thread() -> None:
    before = threading.active_count()
    off = Offline()
    off.emit(_fault(1))
    off.set_step(3)
    assert off.poll() == [] and off.plan(2, 10.0) is None and not off.gone
    assert threading.active_count() == before


NO_BROKER_IN_A_RANK = """
import sys
import flightdeck, flightdeck.trainer.api, flightdeck.trainer.link, flightdeck.trainer.session
import flightdeck.trainer.loop, flightdeck.trainer.checkpointing
bad = sorted(m for m in sys.modules if m == "nats" or m.startswith("nats.") or m.startswith("flightdeck.services."))
print(",".join(bad))
"""


def test_a_rank_imports_no_broker_client_and_no_platform_service() -> None:
    out = subprocess.run([sys.executable, "-c", NO_BROKER_IN_A_RANK], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout.strip()
    assert out == ""


DYING_RANK = """
import os, signal, sys, time
from flightdeck.events.training import FaultInjected
from flightdeck.trainer.link import AgentLink
link = AgentLink(sys.argv[1], "job-l", 3, 0, "node-a", heartbeat_s=0.1)
link.connect(timeout=60)
link.start()
link.emit(FaultInjected(job_id="job-l", rank=3, node="node-a", kind="crash", step=7))
while link.num_pending:
    time.sleep(0.01)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(180)
def test_a_killed_rank_stops_heartbeating_and_what_it_handed_over_is_published(
        nats_server: broker_mod.Broker) -> None:
    ensure_streams_at(nats_server.url)
    with LinkHost(nats_server.url) as host:
        proc = subprocess.run([sys.executable, "-c", DYING_RANK, host.address], timeout=120,
                              cwd=Path(__file__).resolve().parents[2])
        assert proc.returncode == -9
        _wait(lambda: any(isinstance(e, FaultInjected) for _, e in _read(nats_server.url, f"fd.tel.{JOB}.3.>")), 30,
              "the dead rank's fault")
        time.sleep(0.5)
        n = len(_read(nats_server.url, f"fd.tel.{JOB}.3.Heartbeat"))
        assert n >= 3
        time.sleep(0.5)
        assert len(_read(nats_server.url, f"fd.tel.{JOB}.3.Heartbeat")) == n
