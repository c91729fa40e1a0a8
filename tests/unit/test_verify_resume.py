"""A verify goes on from the last clean verify of the job (services/tools/audit/resume.py): over the recorded spike
drill cut while it ran, a verify of the cut leaves a mark; a verify of the whole history from that mark checks the
same decisions as a verify from the first event, folding only what came after; a forged decision after the mark is
caught; a mark of another stream or of other code is not used."""

from pathlib import Path
from typing import Any

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.codec import encode
from flightdeck.events.job import JobFailed
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.services.shell import snapshots
from flightdeck.services.tools.audit import cores, resume
from flightdeck.services.tools.audit.verify import Verdict, verify
from tests.e2e.test_drill_fixture import loaded

JOB = "spike-000001"
STREAM = "2026-11-29T10:00:00+00:00"


def counts(v: Verdict) -> dict[str, tuple[int, int, int, int]]:
    return {c.service: (c.control_inputs, c.telemetry_inputs, c.decisions, c.effects) for c in v.checks}


async def cut(rows: list[Stored], control_seq: int) -> MemoryStore:
    """The history as it stood when FD_CONTROL reached `control_seq`: telemetry up to the newest tick's position."""
    ticks = [s.event.positions.get(subjects.TELEMETRY, 0) for s in rows
             if s.stream == subjects.CONTROL and s.seq <= control_seq and isinstance(s.event, ClockTick)]
    telemetry_until = max(ticks, default=0)
    store = MemoryStore()
    for s in rows:
        keep = {subjects.CONTROL: s.seq <= control_seq, subjects.TELEMETRY: s.seq <= telemetry_until,
                subjects.DEAD: True}.get(s.stream, False)
        if keep:
            await store.append_bytes(s.subject, s.data, msg_id=s.msg_id)
    return store


async def marked(tmp_path: Path) -> tuple[MemoryStore, resume.Resume, Verdict]:
    """A clean verify of the drill cut two thirds of the way, its mark saved and loaded back."""
    whole, rows = await loaded()
    control = [s.seq for s in rows if s.stream == subjects.CONTROL]
    for at in (control[len(control) * 2 // 3], control[len(control) // 2], control[len(control) // 3]):
        part = await verify(await cut(rows, at), JOB)
        if part.ok:
            break
    else:
        raise AssertionError("no clean cut of the drill")
    resume.save(tmp_path, JOB, STREAM, part.horizon, part.fleet, part.folders, counts(part))
    mark = resume.load(tmp_path, JOB, STREAM, cores.cores())
    assert mark is not None and mark.mark.horizon == part.horizon
    # what the next verify reads of the telemetry: after the lowest position of a core that reads it (not the
    # scheduler's 0: it reads none)
    readers = [f.telemetry_seq for f in mark.folders.values() if f.service.telemetry_subjects]
    assert mark.telemetry_from == min(readers) + 1 and mark.folders["scheduler"].telemetry_seq == 0
    return whole, mark, part


async def test_a_verify_from_a_clean_verifys_mark_checks_what_a_whole_verify_checks(tmp_path: Path) -> None:
    whole, mark, part = await marked(tmp_path)
    full = await verify(whole, JOB)
    assert full.ok and part.horizon < full.horizon
    resumed = await verify(whole, JOB, resume=mark)
    assert resumed.ok and resumed.resumed_from == part.horizon
    assert counts(resumed) == counts(full)
    assert any(c[2] > p[2] for c, p in zip(counts(resumed).values(), counts(part).values(), strict=True))
    for name, folder in resumed.folders.items():  # the same state as the whole refold's
        assert snapshots.digest(folder.state) == snapshots.digest(full.folders[name].state), name


@pytest.mark.parametrize("claims", ["a later input", "an input the mark covers"])
async def test_a_decision_forged_after_the_mark_is_caught_whichever_input_it_claims(tmp_path: Path,
                                                                                     claims: str) -> None:
    whole, mark, part = await marked(tmp_path)
    seq = part.horizon + 1 if claims == "a later input" else 3  # the second: decided then, so checked then
    forged = JobFailed(job_id=JOB, reason="forged", producer="scheduler", job_version=10_000,
                       event_id=f"scheduler:FD_CONTROL:{seq}:9")
    await whole.append_bytes(subjects.job(JOB, "JobFailed"), encode(forged), msg_id=forged.event_id)
    resumed = await verify(whole, JOB, resume=mark)
    assert [(d.kind, d.msg_id) for d in resumed.divergences] == [("not reproduced", forged.event_id)]


@pytest.mark.parametrize("change", ["stream", "code", "corrupt"])
async def test_a_mark_of_another_stream_or_other_code_or_corrupt_is_not_used(tmp_path: Path, change: str) -> None:
    await marked(tmp_path)
    path = resume.path(tmp_path, JOB)
    services: list[Any] = cores.cores()
    stream = STREAM
    if change == "stream":
        stream = "2026-11-30T00:00:00+00:00"  # the same job id on another broker's stream
    elif change == "code":
        m = msgspec.msgpack.decode(path.read_bytes(), type=resume.Mark)
        first = msgspec.structs.replace(m.cores[0], fingerprint="0" * 64)
        path.write_bytes(msgspec.msgpack.encode(msgspec.structs.replace(m, cores=[first, *m.cores[1:]])))
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    assert resume.load(tmp_path, JOB, stream, services) is None
