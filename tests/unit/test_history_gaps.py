"""A job's telemetry read as one sequence, archived segments then the live stream: what aged out before it was
archived, or sits in a segment that cannot be read, comes back as a gap by range (never silently dropped), and
what was archived and is still in the stream is read once."""

from pathlib import Path

import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.archiver.core import Ask
from flightdeck.services.archiver.service import archive
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.tools.cli import EXIT_INCOMPLETE
from flightdeck.services.tools.console.__main__ import main as console_main
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.archived import AGED_OUT, Gap, stream_rows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "histories"

JOB = "j"


async def published(store: MemoryStore, n: int, job: str = JOB, at: float = 100.0) -> None:
    for i in range(n):
        ev = StepCompleted(job_id=job, rank=0, attempt=0, node="n1", step=i, loss=1.0, grad_norm=1.0, lr=1e-3,
                           tokens_per_s=1.0, step_time_s=0.1, event_id=f"{job}-{at}-{i}", occurred_at=at + i)
        await store.append(subjects.telemetry(job, 0, "StepCompleted"), ev)


def ask(from_seq: int, final: bool = False) -> Ask:
    return Ask(job_id=JOB, stream=subjects.TELEMETRY, from_seq=from_seq, final=final, submitted_at=50.0)


async def test_archived_then_live_reads_every_message_once_in_order(tmp_path: Path) -> None:
    store, objects = MemoryStore(), LocalStore(tmp_path)
    await published(store, 4)
    await published(store, 2, job="other")
    [first] = [e.event for e in await archive(store, objects, ask(0))]
    await published(store, 3, at=200.0)
    store.age_out(subjects.TELEMETRY, 5)  # aged past what was archived, not past the stream's end
    rows, gaps = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [first], 50.0)  # type: ignore[list-item]
    assert gaps == []
    assert [r.seq for r in rows] == [1, 2, 3, 4, 7, 8, 9]  # 1-4 from the segment, 7-9 live; "other" is not the job's


async def test_what_aged_out_before_it_was_archived_is_a_gap_by_range(tmp_path: Path) -> None:
    store, objects = MemoryStore(), LocalStore(tmp_path)
    await published(store, 3)
    [first] = [e.event for e in await archive(store, objects, ask(0))]
    await published(store, 5, at=200.0)  # 4..8
    store.age_out(subjects.TELEMETRY, 6)
    rows, gaps = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [first], 50.0)  # type: ignore[list-item]
    assert gaps == [Gap(subjects.TELEMETRY, 4, 6, AGED_OUT)] and [r.seq for r in rows] == [1, 2, 3, 7, 8]
    [late] = [e.event for e in await archive(store, objects, ask(4))]  # the archiver finds the same, and says so
    assert (late.first_seq, late.last_seq, late.count, late.lost_from, late.lost_to) == (4, 8, 2, 4, 6)
    none, _ = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [], 50.0)
    assert [r.seq for r in none] == [7, 8]
    _, never = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [], 50.0)
    assert never == [Gap(subjects.TELEMETRY, 0, 6, AGED_OUT)]  # never archived: from the job's start


async def test_a_segment_that_cannot_be_read_is_a_gap_with_its_error(tmp_path: Path) -> None:
    store, objects = MemoryStore(), LocalStore(tmp_path)
    await published(store, 3)
    [first] = [e.event for e in await archive(store, objects, ask(0, final=True), quiet_s=0)]
    (tmp_path / first.key).write_bytes(b"not a segment")  # type: ignore[attr-defined]
    rows, gaps = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [first], 50.0)  # type: ignore[list-item]
    assert [r.seq for r in rows] == [1, 2, 3] and gaps == []  # the stream still holds them: read from there
    store.age_out(subjects.TELEMETRY, 2)
    rows, gaps = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [first], 50.0)  # type: ignore[list-item]
    assert [r.seq for r in rows] == [3] and len(gaps) == 1
    assert (gaps[0].from_seq, gaps[0].to_seq) == (1, 2) and "sha256 is not the one recorded" in gaps[0].why
    _, offline = await stream_rows(store, None, JOB, subjects.TELEMETRY, [first], 50.0,  # type: ignore[list-item]
                                   unreadable="the object store s3://x cannot be opened: denied")
    assert "cannot be opened: denied" in offline[0].why


async def test_a_final_segment_takes_what_comes_while_the_jobs_messages_still_come(tmp_path: Path) -> None:
    """An agent may store a rank's last events after its exit record (a slow broker) and its upload report after
    that: the final segment reads on until the job's messages stop, so none of them is left for age-out alone."""
    store, objects = MemoryStore(), LocalStore(tmp_path)
    await published(store, 3)
    reads, bounds = 0, store.bounds

    async def arriving(stream: str) -> tuple[int, float, int]:  # two more of the job's, one per look, then none
        nonlocal reads
        reads += 1
        if reads in (2, 3):
            await published(store, 1, at=200.0 + reads)
            await published(store, 1, job="other", at=300.0 + reads)
        return await bounds(stream)

    store.bounds = arriving  # type: ignore[method-assign]
    [final] = [e.event for e in await archive(store, objects, ask(0, final=True), quiet_s=0.05)]
    assert (final.count, final.last_seq, final.final) == (5, 7, True)  # type: ignore[attr-defined]
    assert reads >= 4  # it looked again after the last one came, and found the job quiet
    rows, gaps = await stream_rows(store, objects, JOB, subjects.TELEMETRY, [final], 50.0)  # type: ignore[list-item]
    assert [r.seq for r in rows] == [1, 2, 3, 4, 6] and gaps == []


def test_verify_over_a_history_with_a_gap_says_incomplete_by_range_and_calls_nothing_a_divergence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped crash drill, with the archiver's record that telemetry 40..90 had aged out before it read it:
    verify exits 3 (incomplete), names the range, and lists no divergence."""
    rows = fdh.load(FIXTURES / "crash.fdh.jsonl")
    last = max(r.seq for r in rows if r.stream == subjects.CONTROL)
    lost = HistoryArchived(job_id="crash-000001", stream=subjects.TELEMETRY, first_seq=40, last_seq=95, count=0,
                           bytes=1, sha256="x", key="k", lost_from=40, lost_to=90, event_id="a", producer="archiver",
                           occurred_at=1.0)
    subject = subjects.job("crash-000001", "HistoryArchived")
    rows.append(Stored(subjects.CONTROL, last + 1, subject, codec.encode(lost), "a", lost))
    path = tmp_path / "crash.fdh"
    path.write_bytes(fdh.dumps(rows, job_id="crash-000001", source="test"))
    assert console_main(["verify", "crash-000001", "--from", str(path)]) == EXIT_INCOMPLETE
    out = capsys.readouterr().out
    assert "INCOMPLETE: the history lacks inputs" in out
    assert "missing: FD_TELEMETRY sequences 40 to 90: aged out of the stream before it was archived" in out
    assert "divergence" not in out
