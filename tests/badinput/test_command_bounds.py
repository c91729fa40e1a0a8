"""A rank acts only on commands that pass `codec.admit` after the step-boundary collective: a RollbackRequested
whose checkpoint id climbs out of the node's cache (`../../x`) is refused and logged, and the rank trains on
as if it never came, even when a real checkpoint lies where the traversal leads. One rank in this process."""

import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.commands import CheckpointRequested, RollbackRequested
from flightdeck.trainer.session import admitted
from tests.trainer import ranks

pytestmark = pytest.mark.timeout(60)
JOB = ranks.JOB


def test_a_rollback_whose_checkpoint_id_leaves_the_cache_is_refused_and_not_acted_on(tmp_path: Path) -> None:
    _, log, _, _ = ranks.run_loop(tmp_path / "first", {}, steps=10, every=10)
    (staged,) = ranks.events(log, "CheckpointStaged")
    cache = tmp_path / "cache"
    (cache / JOB).mkdir(parents=True)
    # a whole, loadable checkpoint where the hostile id leads: cache/<job>/../../planted == tmp/planted
    shutil.copytree(staged["staging_dir"], tmp_path / "planted")
    hostile = RollbackRequested(job_id=JOB, checkpoint_id="../../planted", to_step=10, skip_from=10, skip_to=12,
                                reason="test")
    script: dict[tuple[int, int], list[Event]] = {(3, 1): [hostile, CheckpointRequested(job_id=JOB, reason="test")]}
    with capture_logs() as logs:
        code, log, _, loop = ranks.run_loop(tmp_path / "second", script, steps=6, every=100, checkpoints=cache)
    assert code == 0
    assert ranks.events(log, "RolledBack") == []
    assert [s for s, _ in ranks.losses(log, 0)] == list(range(6))  # no step redone, none skipped
    assert loop.cursor.next_batch == 6
    # the refusal is per command: the valid one agreed at the same boundary was obeyed
    assert [e["step"] for e in ranks.events(log, "CheckpointStaged")] == [3]
    (refused,) = [e for e in logs if e["event"] == "refusing a command"]
    assert refused["log_level"] == "error" and "checkpoint_id" in refused["error"]


def test_admitted_keeps_good_commands_and_drops_garbage_and_out_of_bounds_ones() -> None:
    good = CheckpointRequested(job_id=JOB, reason="ok")
    bad_job = CheckpointRequested(job_id="a/b", reason="ok")
    traversal = RollbackRequested(job_id=JOB, checkpoint_id="..", to_step=1, skip_from=1, skip_to=1, reason="x")
    raws = [codec.encode(traversal), b"\xc1 not msgpack", codec.encode(good), codec.encode(bad_job)]
    with capture_logs() as logs:
        assert admitted(raws) == [good]
    assert [e["event"] for e in logs] == ["refusing a command"] * 3
