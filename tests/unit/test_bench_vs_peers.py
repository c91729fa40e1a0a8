"""bench/vs_peers.py reads each side's recovery from the script's own event lines: what it counts as the first
step after recovery, the steps lost and the steps done meanwhile must hold for every kind of peer."""

import json
from pathlib import Path

from bench.vs_peers import finished, measure


def write(workdir: Path, rows: list[dict[str, object]]) -> None:
    (workdir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def steps(pid: int, rank: int, first: int, last: int, t0: float, dt: float = 0.1) -> list[dict[str, object]]:
    return [{"t": t0 + i * dt, "kind": "step", "rank": rank, "pid": pid, "step": s}
            for i, s in enumerate(range(first, last + 1))]


def test_a_restart_from_an_older_save_counts_the_steps_done_again(tmp_path: Path) -> None:
    """torchrun's shape: both ranks stop, both restart from the step-50 save; the fault was at step 60."""
    write(tmp_path, [
        {"t": 0.0, "kind": "start", "rank": 0, "pid": 1, "step": 0},
        {"t": 0.0, "kind": "start", "rank": 1, "pid": 2, "step": 0},
        {"t": 5.0, "kind": "save", "rank": 0, "pid": 1, "step": 50, "stall_s": 0.5},
        {"t": 5.0, "kind": "save", "rank": 1, "pid": 2, "step": 50, "stall_s": 0.01},
        {"t": 1.0, "kind": "save", "rank": 0, "pid": 1, "step": 10, "stall_s": 0.25},
        *steps(1, 0, 0, 59, 0.05), *steps(2, 1, 0, 59, 0.05),
        {"t": 6.25, "kind": "fault", "rank": 1, "pid": 2, "step": 60},
        {"t": 9.0, "kind": "start", "rank": 0, "pid": 3, "step": 50},
        *steps(3, 0, 50, 89, 9.5, 0.125),  # binary fractions: the differences are exact
    ])
    m = measure(tmp_path, cap_s=40)
    assert m["recover_s"] == 3.25
    assert m["progress_s"] == 4.5  # new work only once steps 50-59 are redone
    assert (m["resumed_from_step"], m["last_step_before"], m["lost_steps"]) == (50, 59, 10)
    assert m["steps_meanwhile"] == 0
    assert (m["saves"], m["stall_s"], m["stall_max_s"]) == (2, 0.375, 0.5)  # the slowest rank's hold, per save


def test_a_survivor_that_trains_on_loses_nothing_and_its_steps_meanwhile_count(tmp_path: Path) -> None:
    """torchft's shape: replica 1 crashes at step 60, replica 0 commits steps 60-79 alone, the restarted replica
    takes the live state and joins at step 80 (the
    survivor's step 80 comes after)."""
    write(tmp_path, [
        {"t": 0.0, "kind": "start", "rank": 0, "pid": 1, "step": 0},
        *steps(1, 0, 0, 59, 0.0), *steps(2, 1, 0, 59, 0.0),
        {"t": 6.0, "kind": "fault", "rank": 1, "pid": 2, "step": 60},
        *steps(1, 0, 60, 89, 6.25, 0.125),
        {"t": 8.0, "kind": "start", "rank": 1, "pid": 4, "step": 0},  # torchft's step before it heals
        {"t": 8.25, "kind": "step", "rank": 1, "pid": 4, "step": 0, "participants": 1},  # alone: not rejoined yet
        *steps(4, 1, 80, 89, 8.6875, 0.125),  # between the survivor's steps 79 and 80
    ])
    m = measure(tmp_path, cap_s=40)
    assert m["lost_steps"] == 0 and m["resumed_from_step"] == 80
    assert m["recover_s"] == 2.6875
    assert m["progress_s"] == 0.25  # the survivor's step 60
    assert m["steps_meanwhile"] == 20  # steps 60..79 by the survivor before the restarted replica's first step
    assert m["stall_s"] is None and m["saves"] == 0


def test_no_recovery_within_the_cap_is_null_and_the_run_ends_at_the_cap(tmp_path: Path) -> None:
    write(tmp_path, [*steps(1, 0, 0, 59, 0.0), {"t": 100.0, "kind": "fault", "rank": 0, "pid": 1, "step": 60}])
    m = measure(tmp_path, cap_s=40)
    assert m["recover_s"] is None and m["progress_s"] is None and m["lost_steps"] is None
    assert m["steps_meanwhile"] == 0
    assert finished(tmp_path, cap_s=40, began=0.0, limit_s=1e12)  # the fault is far in the past (t=100)


def test_a_run_is_finished_once_restarted_processes_did_ten_steps_past_the_fault(tmp_path: Path) -> None:
    import time

    now = time.time()
    old = [*steps(1, 0, 0, 70, now - 5, 0.0), {"t": now - 4, "kind": "fault", "rank": 0, "pid": 1, "step": 60}]
    write(tmp_path, [*old, *steps(1, 0, 71, 200, now - 3, 0.0), *steps(2, 0, 50, 68, now - 3, 0.0)])
    assert not finished(tmp_path, cap_s=40, began=now, limit_s=300)  # old processes, and steps redone, never count
    write(tmp_path, [*old, *steps(2, 0, 50, 69, now - 3, 0.0)])
    assert finished(tmp_path, cap_s=40, began=now, limit_s=300)
