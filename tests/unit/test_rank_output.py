"""The pieces of a rank's output pump: line splitting (long lines cut, saying how much), the rate budget, and
a whole pump over a real pipe: the node's file gets every byte, the broker every line within the budget and
a count of the rest."""

import asyncio
import os
from pathlib import Path

import pytest

from flightdeck.events.logs import MAX_LINE, RankOutput
from flightdeck.services.agent import output
from flightdeck.services.agent.output import Budget, Lines, OutputPump, cut
from flightdeck.services.agent.rankproc import last_lines


def test_lines_split_on_newlines_and_carriage_returns_and_keep_the_unfinished_one() -> None:
    s = Lines()
    assert s.feed(b"one\ntw") == ["one"]
    assert s.feed(b"o\r\n10%\r20%\rdone") == ["two", "10%", "20%"]
    assert s.finish() == ["done"] and s.finish() == []
    assert s.feed(b"\xff\xfe bad bytes\n") == ["\ufffd\ufffd bad bytes"]


def test_a_long_line_is_cut_saying_how_much() -> None:
    assert cut("a" * MAX_LINE) == "a" * MAX_LINE
    assert cut("a" * (MAX_LINE + 10)) == "a" * MAX_LINE + "... [10 more characters cut]"
    endless = Lines().feed(b"z" * (5 * MAX_LINE))  # no newline ever: shipped rather than held
    assert len(endless) == 1 and endless[0].endswith(f"[{4 * MAX_LINE} more characters cut]")


def test_the_budget_allows_its_burst_then_its_rate() -> None:
    b = Budget(rate=10.0, burst=5.0)
    assert [b.take(100.0, 1) for _ in range(6)] == [True] * 5 + [False]
    assert b.take(100.15, 1) and not b.take(100.15, 1)  # 0.15 s at 10/s: one more (and a half)
    assert b.take(200.0, 5) and not b.take(200.0, 1)  # refilled to the burst, no more


@pytest.mark.parametrize("lines", [30, 5000])
async def test_a_pump_ships_every_line_or_counts_it_and_keeps_every_byte(
        tmp_path: Path, lines: int) -> None:
    got: list[RankOutput] = []

    async def publish(event: RankOutput) -> None:
        got.append(event)

    read, write = os.pipe()
    pump = OutputPump(read, tmp_path / "rank.log", publish, job_id="j", attempt=2, rank=1, node="n", producer="a")
    task = asyncio.create_task(pump.run())
    text = "".join(f"line {i}\n" for i in range(lines)).encode()
    await asyncio.to_thread(os.write, write, text)
    os.close(write)
    await asyncio.wait_for(task, 60)
    assert (tmp_path / "rank.log").read_bytes() == text
    shipped = [line for e in got for line in e.lines]
    dropped = sum(e.dropped for e in got)
    assert len(shipped) + dropped == lines
    assert shipped[: min(lines, int(output.LINE_BURST))] == [f"line {i}" for i in range(min(lines, 2000))]
    assert all(e.first_line + len(e.lines) <= lines and (e.job_id, e.attempt, e.rank) == ("j", 2, 1) for e in got)
    if lines > output.LINE_BURST:
        assert dropped > 0
    else:
        assert dropped == 0


async def test_counts_of_lines_left_out_come_before_their_place_and_never_take_a_batchs_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst over the budget, a pause (held lines go out as the budget refills), lines again, and a last burst
    (held, and shipped once the rank ends: its final words): read in order, each event's `dropped` lines sit just
    before its `first_line`, so the events tile every line printed, and no two events share an id (the broker
    would drop the second as a resend)."""
    monkeypatch.setattr(output, "LINE_BURST", 5.0)
    monkeypatch.setattr(output, "LINES_PER_S", 10.0)
    got: list[RankOutput] = []

    async def publish(event: RankOutput) -> None:
        got.append(event)

    read, write = os.pipe()
    pump = OutputPump(read, tmp_path / "rank.log", publish, job_id="j", attempt=0, rank=0, node="n", producer="a")
    task = asyncio.create_task(pump.run())
    printed = 0
    for count, pause in [(20, 0.6), (3, 0.0), (10, 0.0)]:
        await asyncio.to_thread(os.write, write, "".join(f"line {printed + i}\n" for i in range(count)).encode())
        printed += count
        await asyncio.sleep(pause)
    os.close(write)
    await asyncio.wait_for(task, 60)

    assert len({e.event_id for e in got}) == len(got)
    at = 0
    for e in got:
        assert e.first_line - e.dropped == at, [(x.first_line, len(x.lines), x.dropped) for x in got]
        assert e.lines == [f"line {n}" for n in range(e.first_line, e.first_line + len(e.lines))]
        at = e.first_line + len(e.lines)
    assert at == printed
    shipped = {n for e in got for n in range(e.first_line, e.first_line + len(e.lines))}
    assert 5 in shipped  # held over the first burst, shipped in the pause as the budget refilled
    assert set(range(printed - 10, printed)) <= shipped  # the last burst, over the budget: held, shipped at the end


async def test_a_flood_ends_with_its_traceback_shipped_and_the_node_file_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank printing far past its budget (6 MB/s in the trial: 4 of 202 of its own status lines survived) and
    then crashing: the traceback it ends with reaches FD_LOGS whole, every line is shipped or counted once, and
    its node file is rotated at the cap instead of growing (100 MB per rank in 16 s in the trial)."""
    monkeypatch.setattr(output, "LOG_FILE_BYTES", 50_000)
    got: list[RankOutput] = []

    async def publish(event: RankOutput) -> None:
        got.append(event)

    read, write = os.pipe()
    log = tmp_path / "rank.log"
    pump = OutputPump(read, log, publish, job_id="j", attempt=0, rank=0, node="n", producer="a")
    task = asyncio.create_task(pump.run())
    flood = "".join(f"spam {i} " + "x" * 40 + "\n" for i in range(20_000))
    tail = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nRuntimeError: boom\n"
    await asyncio.to_thread(os.write, write, (flood + tail).encode())
    os.close(write)
    await asyncio.wait_for(task, 60)
    shipped = [line for e in got for line in e.lines]
    assert shipped[-3:] == tail.splitlines()
    assert len(shipped) + sum(e.dropped for e in got) == 20_003
    bound = 50_000 + output.READ_CHUNK  # the cap, and one read that began below it
    assert 0 < log.stat().st_size <= bound and 0 < output.rotated(log).stat().st_size <= bound
    assert last_lines(log).endswith("RuntimeError: boom")


async def test_the_api_s_lines_and_a_traceback_go_ahead_of_a_flood(tmp_path: Path) -> None:
    """In the trial a chatty rank's own status lines drowned among its spam (4 of 202 survived at ~6 MB/s): the
    trainer API's lines, a traceback and a warning printed mid-flood are shipped whole, on their own budget; the
    spam around them is shipped or counted as before, each line once and in order."""
    got: list[RankOutput] = []

    async def publish(event: RankOutput) -> None:
        got.append(event)

    read, write = os.pipe()
    pump = OutputPump(read, tmp_path / "rank.log", publish, job_id="j", attempt=0, rank=0, node="n", producer="a")
    task = asyncio.create_task(pump.run())
    printed: list[str] = []
    status = [f"2026-11-28 10:50:{s:02d} [info     ] step done                      step={s}" for s in range(200)]
    trace = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>', "    boom()",
             "ValueError: a caught one, printed", "spam after the traceback"]
    warned = ["train.py:12: UserWarning: the loader has 0 workers", "WARNING:root:loss scale lowered to 1024"]
    for i, line in enumerate(status):
        printed += [f"spam {i}.{j} " + "x" * 40 for j in range(100)] + [line]
        if i == 100:
            printed += trace
        if i == 150:
            printed += warned
    await asyncio.to_thread(os.write, write, "".join(f"{line}\n" for line in printed).encode())
    os.close(write)
    await asyncio.wait_for(task, 60)

    shipped = [line for e in got for line in e.lines]
    assert [line for line in shipped if "[info" in line] == status
    start = shipped.index(trace[0])
    assert shipped[start:start + 4] == trace[:4]  # whole, up to its exception's line
    assert all(line in shipped for line in warned)  # stderr's usual lines, by their form
    assert len(shipped) + sum(e.dropped for e in got) == len(printed)
    at = 0
    for e in got:  # the events still tile the lines printed, in order
        assert e.first_line - e.dropped == at
        assert e.lines == printed[e.first_line:e.first_line + len(e.lines)]
        at = e.first_line + len(e.lines)
