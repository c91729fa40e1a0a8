"""The loop obeys commands at step boundaries: one rank in this process, a hand-written scripted inbox,
events read back from the JSON-lines log; then once through a real broker and `python -m flightdeck.trainer`."""

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.commands import (
    CheckpointRequested,
    PauseRequested,
    ResumeRequested,
    RollbackRequested,
    StopRequested,
)
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.services.shell import broker as broker_mod
from flightdeck.trainer.session import PAUSE_POLL_S
from tests.conftest import ensure_streams_at
from tests.trainer import ranks
from tests.trainer.linkhost import LinkHost

JOB = ranks.JOB


def cmd(cls: type[Event], **kw: object) -> Event:
    return cls(job_id=JOB, **kw)


def test_rollback_restores_the_checkpoint_and_skips_the_window(tmp_path: Path) -> None:
    rollback = cmd(RollbackRequested, checkpoint_id="step-10", to_step=10, skip_from=10, skip_to=15, reason="spike")
    code, log, _, loop = ranks.run_loop(tmp_path, {(20, 1): [rollback]})
    assert code == 0
    steps = [s for s, _ in ranks.losses(log, 0)]
    assert steps == list(range(20)) + list(range(10, 30))
    (rb,) = ranks.events(log, "RolledBack")
    assert (rb["checkpoint_id"], rb["to_step"], rb["skip_from"], rb["skip_to"]) == ("step-10", 10, 10, 15)
    assert loop.cursor.next_batch == 35  # batches 10..14 were skipped after the rollback
    first, second = (loss for s, loss in ranks.losses(log, 0) if s == 10)
    assert first != second  # step 10 read batch 15 the second time
    # Commands come before the periodic save at a boundary: step 20 was saved only on the new timeline.
    staged = [(e["step"], e["data"]) for e in ranks.events(log, "CheckpointStaged")]
    assert staged == [(10, {"next_batch": 10, "skipped": []}), (20, {"next_batch": 25, "skipped": [[10, 15]]}),
                      (30, {"next_batch": 35, "skipped": [[10, 15]]})]


def test_a_replayed_rollback_trains_the_window_again_reports_it_then_lands_as_a_plain_one(tmp_path: Path) -> None:
    """policy.spike_diagnosis: from the checkpoint the same batches again (their losses in SpikeReplayed, no step
    records, no checkpoint), then the checkpoint again and the skip: the run goes on exactly as without the re-run."""
    plain = cmd(RollbackRequested, checkpoint_id="step-10", to_step=10, skip_from=10, skip_to=15, reason="spike")
    replay = msgspec.structs.replace(plain, replay=True)
    _, plain_log, _, _ = ranks.run_loop(tmp_path / "plain", {(20, 1): [plain]})
    code, log, _, loop = ranks.run_loop(tmp_path / "replay", {(20, 1): [replay]})
    assert code == 0
    assert ranks.losses(log, 0) == ranks.losses(plain_log, 0)  # bitwise: the re-run left nothing behind
    (again,) = ranks.events(log, "SpikeReplayed")
    assert (again["checkpoint_id"], again["from_step"]) == ("step-10", 10)
    first = [loss for s, loss in ranks.losses(log, 0)[:20] if s >= 10]
    assert again["losses"] == first  # steps 10..19 read batches 10..19 again: CPU training is deterministic
    (landed,) = ranks.events(log, "RolledBack")
    assert landed["occurred_at"] >= again["occurred_at"]  # reported before the rollback lands
    assert loop.cursor.next_batch == 35
    staged = [e["step"] for e in ranks.events(log, "CheckpointStaged")]
    assert staged == [10, 20, 30]  # none of the re-run's steps was saved


def test_pause_holds_the_step_until_resume(tmp_path: Path) -> None:
    script = {(5, 1): [cmd(PauseRequested)], (5, 4): [cmd(ResumeRequested)]}
    code, log, inbox, _ = ranks.run_loop(tmp_path, script, steps=8)
    assert code == 0
    assert inbox.polls_at[5] == 4  # paused: the loop kept polling at step 5 and ran no step
    done = ranks.events(log, "StepCompleted")
    assert [e["step"] for e in done] == list(range(8))
    assert done[5]["occurred_at"] - done[4]["occurred_at"] >= 3 * PAUSE_POLL_S


def test_stop_with_checkpoint_saves_then_exits_as_stopped(tmp_path: Path) -> None:
    script = {(3, 1): [cmd(CheckpointRequested)], (7, 1): [cmd(StopRequested, checkpoint=True)]}
    code, log, _, _ = ranks.run_loop(tmp_path, script)
    assert code == STOPPED_EXIT  # not 0: that says every step ran
    assert [s for s, _ in ranks.losses(log, 0)] == list(range(7))
    assert [e["step"] for e in ranks.events(log, "CheckpointStaged")] == [3, 7]
    assert (tmp_path / "staging" / JOB / "step-7" / ".metadata").exists()


def test_a_rank_whose_agent_vanished_stops_at_the_next_boundary_without_a_checkpoint(tmp_path: Path) -> None:
    """Nobody could publish its checkpoint or hear it: it stops rather than train blind, as a stopped rank (75)."""
    code, log, _, run = ranks.run_loop(tmp_path, {}, steps=30, every=5, gone_at=12)
    assert code == STOPPED_EXIT and run.step == 12 and not run.ran_all
    assert [s for s, _ in ranks.losses(log, 0)] == list(range(12))
    assert [e["step"] for e in ranks.events(log, "CheckpointStaged")] == [5, 10]  # none at the stop


def test_commands_arrive_through_the_agent(nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    """Two real ranks linked to a real agent end (services/agent/links.py): rank 0 hears the commands, and both obey
    them at the same boundary."""
    ensure_streams_at(nats_server.url)
    spec = ranks.write_spec(tmp_path / "job.toml", slots=2, train={"steps": 100_000, "checkpoint_every": 100_000})
    log = tmp_path / "events.jsonl"
    with LinkHost(nats_server.url) as host:
        args = (*host.args(), "--sync-every", "5")
        with ranks.started(tmp_path, spec, world=2, job_id=JOB, args=args) as procs:
            ranks.wait_for(lambda: len(ranks.events(log, "StepCompleted", 1)) >= 3, ranks.RUN_TIMEOUT_S, "steps")
            for c in (cmd(CheckpointRequested, reason="test"), cmd(StopRequested, checkpoint=False)):
                host.call(lambda links, c=c: links.command(JOB, 0, codec.encode(c)))
            assert ranks.wait(procs, ranks.RUN_TIMEOUT_S) == [STOPPED_EXIT] * 2, ranks.log_tail(tmp_path, 2)
    staged = ranks.events(log, "CheckpointStaged")
    assert sorted(e["rank"] for e in staged) == [0, 1] and len({e["step"] for e in staged}) == 1
    stopped = {ranks.events(log, "StepCompleted", r)[-1]["step"] + 1 for r in (0, 1)}
    assert len(stopped) == 1  # only rank 0's commands count; both ranks stopped at the same boundary
    # Commands are agreed every --sync-every steps: both took effect at such boundaries.
    (stopped_at,) = stopped
    assert staged[0]["step"] % 5 == 0 and stopped_at % 5 == 0 and staged[0]["step"] <= stopped_at


pytestmark = pytest.mark.timeout(300)  # hang guards: each test starts ranks (torch) on a loaded box


def test_rollback_takes_the_committed_checkpoint_from_the_node_cache_and_verifies_it(tmp_path: Path) -> None:
    code, log, _, _ = ranks.run_loop(tmp_path / "first", {}, steps=10, every=10)
    (staged,) = ranks.events(log, "CheckpointStaged")
    cid = "step000000010-a0"  # the checkpoint service's id: nothing in this run's staging has that name
    cache = tmp_path / "cache"
    shutil.copytree(staged["staging_dir"], cache / JOB / cid)
    (cache / JOB / cid / "MANIFEST.json").write_text(json.dumps({"checkpoint_id": cid, "shards": staged["shards"]}))
    rollback = cmd(RollbackRequested, checkpoint_id=cid, to_step=10, skip_from=10, skip_to=12, reason="test")
    code, log, _, loop = ranks.run_loop(tmp_path / "second", {(3, 1): [rollback]}, steps=12, every=100,
                                        checkpoints=cache)
    assert code == 0 and loop.cursor.next_batch == 14
    assert [s for s, _ in ranks.losses(log, 0)] == [0, 1, 2, 10, 11]

    shard = cache / JOB / cid / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Damaged: refused before anything is loaded, said in CheckpointRefused, and the rank trains on.
    code, log, _, _ = ranks.run_loop(tmp_path / "third", {(3, 1): [rollback]}, steps=12, every=100,
                                     checkpoints=cache)
    assert code == 0 and ranks.events(log, "RolledBack") == []
    (refused,) = ranks.events(log, "CheckpointRefused")
    assert (refused["checkpoint_id"], refused["to_step"]) == (cid, 10)
    assert "__0_0.distcp" in refused["cause"] and "sha256" in refused["cause"], refused
    assert [s for s, _ in ranks.losses(log, 0)] == list(range(12))
