"""What an agent says its ranks' snapshots hold in its memory (services/agent/nodeview.py): measured in blocks, and
said coarsely, so that slots rewritten in place every step are not an event every second."""

from pathlib import Path

from flightdeck.services.agent.nodeview import coarse, held_bytes


def test_what_is_said_moves_only_by_a_sixteenth_or_a_mebibyte() -> None:
    assert coarse(0) == 0 and coarse(-1) == -1
    assert coarse(5) == 0 and coarse(2**20 - 1) == 0 and coarse(2**20) == 2**20  # under a MiB: nothing yet
    gib = 2**30
    assert coarse(gib) == gib and coarse(gib + 2**20) == gib  # a few pages more: the same
    assert coarse(gib + gib // 16) == gib + gib // 16  # a sixteenth more: said
    for n in (3 * 2**20 + 7, 10**9, 123_456_789_012):
        assert n - n / 16 <= coarse(n) <= n


def test_held_bytes_counts_the_snapshots_blocks_and_none_when_off(tmp_path: Path) -> None:
    assert held_bytes(None) == -1
    assert held_bytes(tmp_path / "not-yet") == 0
    job = tmp_path / "j-000001" / "a0"
    job.mkdir(parents=True)
    (job / "r0.slot0").write_bytes(b"x" * 100_000)
    (job / "r0.slot1").write_bytes(b"")
    assert 100_000 <= held_bytes(tmp_path) < 100_000 + 2 * 8192  # whole blocks of what was written
