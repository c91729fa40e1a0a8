"""Each drill fault does what it says: announced first (FaultInjected), then acted on."""

import asyncio
import math
import signal
import statistics
import time
from pathlib import Path

import nats
import pytest

from flightdeck.events import subjects
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.streams import ensure_streams
from flightdeck.events.training import Heartbeat
from flightdeck.services.shell import broker as broker_mod
from flightdeck.trainer.faults import CRASH_EXIT_CODE, HANG_EXIT_CODE, SPIKE_BATCHES
from tests.trainer import ranks
from tests.trainer.linkhost import JOB, LinkHost, read_telemetry

pytestmark = pytest.mark.timeout(300)  # hang guards: each test starts ranks (torch) on a loaded box


def injected(log: Path) -> list[tuple[str, int, int]]:
    return [(e["kind"], e["step"], e["rank"]) for e in ranks.events(log, "FaultInjected")]


def test_crash_exits_with_the_crash_code_and_the_peer_fails(tmp_path: Path) -> None:
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, faults=[{"kind": "crash", "step": 5, "rank": 1}])
    codes = ranks.run(tmp_path, spec, world=2)
    log = tmp_path / "events.jsonl"
    assert codes[1] == CRASH_EXIT_CODE, ranks.log_tail(tmp_path, 2)
    assert codes[0] not in (0, CRASH_EXIT_CODE)  # the survivor's collective broke: a real failure
    assert injected(log) == [("crash", 5, 1)]
    assert [s for s, _ in ranks.losses(log, 1)] == list(range(5))
    (fault,) = ranks.events(log, "RankFault", 0)
    assert fault["kind"] == "exception"


def test_a_fault_for_another_attempt_does_not_fire(tmp_path: Path) -> None:
    code, log, _, _ = ranks.run_loop(tmp_path, {}, steps=6, faults=[{"kind": "crash", "step": 2, "attempt": 1}])
    assert code == 0 and injected(log) == []


def _telemetry(url: str, pattern: str) -> list[Heartbeat]:
    return [e for _, e in read_telemetry(url, pattern) if isinstance(e, Heartbeat)]


def _streams(url: str) -> None:
    async def go() -> None:
        nc = await nats.connect(url)
        await ensure_streams(nc.jetstream())
        await nc.close()

    asyncio.run(go())


def test_hang_freezes_the_step_while_heartbeats_go_on(nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    _streams(nats_server.url)
    spec = ranks.write_spec(tmp_path / "job.toml", policy={"heartbeat_interval_s": 0.2},
                            faults=[{"kind": "hang", "step": 5}])
    with LinkHost(nats_server.url) as host, ranks.started(tmp_path, spec, world=1, job_id=JOB,
                                                          args=host.args()) as (proc,):
        log = tmp_path / "events.jsonl"
        ranks.wait_for(lambda: injected(log) == [("hang", 5, 0)], ranks.RUN_TIMEOUT_S, "the hang to start")
        time.sleep(1.5)
        assert proc.poll() is None
        beats = _telemetry(nats_server.url, subjects.telemetry(JOB, 0, "Heartbeat"))
        assert [b.step for b in beats[-5:]] == [4] * 5  # alive and stuck after step 4
        proc.send_signal(signal.SIGTERM)
        assert ranks.wait([proc], 20) == [HANG_EXIT_CODE]
    assert [s for s, _ in ranks.losses(log, 0)] == list(range(5))
    assert ranks.events(log, "CheckpointStaged") == []  # a hung rank cannot take part in a save


def test_loss_spike_shows_and_a_rollback_that_skips_the_window_removes_it(tmp_path: Path) -> None:
    spike = 20
    rollback = RollbackRequested(job_id=ranks.JOB, checkpoint_id="step-20", to_step=20, skip_from=spike,
                                 skip_to=spike + SPIKE_BATCHES, reason="spike")
    code, log, _, _ = ranks.run_loop(tmp_path, {(25, 1): [rollback]}, steps=30, every=10,
                                     faults=[{"kind": "loss_spike", "step": spike}])
    assert code == 0 and injected(log) == [("loss_spike", spike, 0)]
    seen = ranks.losses(log, 0)
    first = dict(seen[:25])
    after = dict(seen[25:])
    before = statistics.median(first[s] for s in range(spike - 5, spike))
    assert first[spike] > 1.5 * before  # the spike is plain to see
    assert all(after[s] < 1.1 * before for s in range(spike, 30))  # gone after rollback + skip


def test_a_nonfinite_fault_reports_nan_on_its_rank_at_its_step(tmp_path: Path) -> None:
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, train={"steps": 10},
                            faults=[{"kind": "nonfinite", "step": 5, "rank": 0}])
    assert ranks.run(tmp_path, spec, world=2) == [0, 0], ranks.log_tail(tmp_path, 2)
    log = tmp_path / "events.jsonl"
    assert injected(log) == [("nonfinite", 5, 0)]
    faults = sorted((e["rank"], e["kind"], e["step"]) for e in ranks.events(log, "RankFault"))
    assert faults == [(0, "nonfinite", 5)]  # injected in what the rank reports, as for any script
    zero = dict(ranks.losses(log, 0))
    assert math.isnan(zero[5])
    assert all(math.isfinite(zero[s]) for s in range(10) if s != 5)  # the weights were not poisoned


def test_slow_sleeps_every_step_from_its_step(tmp_path: Path) -> None:
    code, log, _, _ = ranks.run_loop(tmp_path, {}, steps=8, faults=[{"kind": "slow", "step": 5, "seconds": 2.0}])
    assert code == 0 and injected(log) == [("slow", 5, 0)]
    times = {e["step"]: e["step_time_s"] for e in ranks.events(log, "StepCompleted")}
    assert all(times[s] >= 2.0 for s in (5, 6, 7))
    # Relative, not absolute: a loaded 2-core box has made a plain step take 1.4 s (while a slow step's own
    # compute, during its sleep, took 0.04 s), so the delay must stand well clear of that noise.
    normal = statistics.median(times[s] for s in range(1, 5))
    assert min(times[s] for s in (5, 6, 7)) - normal >= 0.5
