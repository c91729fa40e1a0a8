"""A snapshot's sums from the helper process (trainer/digester.py) are the ones the rank would take itself, item by
item; a helper that dies, errs or stops answering leaves the rank summing in its own process, with the same sums."""

import os
import signal
import time
from pathlib import Path

import pytest

from flightdeck.events import snapshot as fmt
from flightdeck.trainer import digester as digester_mod
from flightdeck.trainer.digester import Digester, sums


def _slot(tmp_path: Path) -> tuple[Path, bytes, list[tuple[int, int]]]:
    data = os.urandom(1 << 20)
    path = tmp_path / "r0.bin"
    path.write_bytes(data)
    ranges = [(0, 4), (64, 512), (1024, 65536), (70000, 0), (100_000, (1 << 20) - 100_000)]
    return path, data, ranges


def helped(d: Digester, path: Path, ranges: list[tuple[int, int]], data: bytes) -> list[int]:
    """Sums until the helper takes them, or is given up on: the first are the rank's own while it starts."""
    deadline = time.monotonic() + 120
    while True:
        got = d.digests(path, ranges, memoryview(data))
        if d.helped or d._broken is not None or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_the_helper_sums_each_range_as_the_rank_would(tmp_path: Path) -> None:
    path, data, ranges = _slot(tmp_path)
    d = Digester()
    try:
        first = d.digests(path, ranges, memoryview(data))  # summed here: the helper is starting
        assert first == [fmt.digest(data[at:at + n]) for at, n in ranges] and not d.helped
        got = helped(d, path, ranges, data)
        assert got == first
        assert d.helped and d._proc is not None and d._proc.poll() is None  # answered by the helper, still running
        path.write_bytes(bytes(reversed(data)))  # the slot rewritten: the next request maps it anew
        assert d.digests(path, ranges, memoryview(b"")) == sums(memoryview(bytes(reversed(data))), ranges)
    finally:
        d.close()
    assert d._proc is None


def test_a_dead_helper_leaves_the_rank_summing_itself(tmp_path: Path) -> None:
    path, data, ranges = _slot(tmp_path)
    d = Digester()
    try:
        helped(d, path, ranges, data)
        assert d.helped and d._proc is not None
        os.kill(d._proc.pid, signal.SIGKILL)
        d._proc.wait()
        assert d.digests(path, ranges, memoryview(data)) == sums(memoryview(data), ranges)
        assert not d.helped and d._proc is None
        assert d.digests(path, ranges, memoryview(data)) == sums(memoryview(data), ranges)  # and from then on
    finally:
        d.close()


def test_a_helper_that_cannot_read_the_slot_says_why_and_the_rank_sums_itself(tmp_path: Path) -> None:
    _, data, ranges = _slot(tmp_path)
    d = Digester()
    try:
        assert helped(d, tmp_path / "gone.bin", ranges, data) == sums(memoryview(data), ranges)
        assert d._broken is not None and "FileNotFoundError" in d._broken
    finally:
        d.close()


def test_a_stuck_helper_is_given_up_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, data, ranges = _slot(tmp_path)
    d = Digester()
    try:
        helped(d, path, ranges, data)
        assert d.helped and d._proc is not None
        monkeypatch.setattr(digester_mod, "ANSWER_S", 0.5)  # once it is up: a loaded box starts it slowly
        os.kill(d._proc.pid, signal.SIGSTOP)  # frozen, not dead: its pipe stays open
        assert d.digests(path, ranges, memoryview(data)) == sums(memoryview(data), ranges)
        assert d._broken is not None and "did not answer" in d._broken and d._proc is None
    finally:
        d.close()
