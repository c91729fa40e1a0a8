"""Snapshot roots whose agent is dead and whose platform is gone are reclaimed by the next agent to start on the
machine (issue 51, case 7: after a day of trials 52 roots held 800 MB of shared memory). Roots of live agents, and
of dead agents whose data dir is still there (their next agent persists what they hold), are left alone.

Real processes and folders: a child process that has exited stands for a dead agent."""

import json
import os
import subprocess
import sys
from pathlib import Path

from flightdeck.services.agent import shmroots


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def root(shm: Path, name: str, *, pid: int | None, data_dir: Path | None, payload: int = 0) -> Path:
    r = shm / f"flightdeck-{name}"
    (r / "job-000001" / "a0-r0-s0").mkdir(parents=True) if payload else r.mkdir(parents=True)
    if payload:
        (r / "job-000001" / "a0-r0-s0" / "state.bin").write_bytes(b"x" * payload)
    if pid is not None and data_dir is not None:
        (r / shmroots.OWNER).write_text(json.dumps({"pid": pid, "data_dir": str(data_dir)}))
    return r


def test_a_dead_agents_root_is_reclaimed_once_its_data_dir_is_gone(tmp_path: Path) -> None:
    shm, kept_dir = tmp_path / "shm", tmp_path / "still-here"
    kept_dir.mkdir()
    own = shm / "flightdeck-n1-own"
    shmroots.claim(own, tmp_path / "data")
    gone = root(shm, "n1-gone", pid=dead_pid(), data_dir=tmp_path / "removed", payload=8192)
    waiting = root(shm, "n1-waits", pid=dead_pid(), data_dir=kept_dir, payload=4096)  # its next agent may persist it
    live = root(shm, "n2-live", pid=os.getpid(), data_dir=tmp_path / "removed", payload=4096)
    empty = root(shm, "n1-empty", pid=None, data_dir=None)
    legacy = root(shm, "n1-legacy", pid=None, data_dir=None, payload=4096)  # unmarked, holding a slot: left
    other = shm / "not-ours"
    other.mkdir()

    freed = shmroots.reclaim(own)
    assert sorted((p.name, why.split(" ")[0]) for p, _, why in freed) == [("flightdeck-n1-empty", "empty"),
                                                                          ("flightdeck-n1-gone", "its")]
    assert dict((p.name, size) for p, size, _ in freed)["flightdeck-n1-gone"] >= 8192
    assert not gone.exists() and not empty.exists()
    assert waiting.exists() and live.exists() and legacy.exists() and other.exists() and own.exists()
    assert json.loads((own / shmroots.OWNER).read_text())["pid"] == os.getpid()
    assert shmroots.reclaim(own) == []  # nothing more to free


def test_nothing_is_reclaimed_beside_a_root_outside_shared_memory(tmp_path: Path) -> None:
    """A root in the agent's data dir (no /dev/shm, or `--snapshots DIR`): its siblings are not snapshot roots."""
    own = tmp_path / "data" / "snapshots"
    shmroots.claim(own, tmp_path / "data")
    stray = root(tmp_path / "data", "n1-x", pid=dead_pid(), data_dir=tmp_path / "removed")
    assert shmroots.reclaim(own) == [] and stray.exists()


def test_down_says_what_its_agents_left_in_shared_memory_and_nothing_of_other_platforms(tmp_path: Path) -> None:
    """`flightdeck down` stops the agents of one data dir; the snapshots of its jobs still live stay for the next
    `up` to persist, and down says so, with the bytes, the jobs and how to free them now."""
    from flightdeck.services.tools.console.down import left_in_memory

    shm = tmp_path / "shm"
    shm.mkdir()
    up = tmp_path / "platform"
    mine = root(shm, "n1-mine", pid=dead_pid(), data_dir=up / "agent-n1", payload=50_000)
    root(shm, "n1-other", pid=dead_pid(), data_dir=tmp_path / "elsewhere", payload=50_000)
    root(shm, "n2-empty", pid=dead_pid(), data_dir=up / "agent-n2")
    (said,) = left_in_memory(up, shm)
    assert "of 1 live job(s) (job-000001)" in said and str(mine) in said and f"rm -rf {mine}" in said, said
    assert "MiB of snapshots" in said
    assert left_in_memory(tmp_path / "nothing-here", shm) == []
