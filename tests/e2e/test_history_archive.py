"""A job's whole history outlives the streams' age-out: with the telemetry and output streams shrunk to a few KB, a
crash drill's telemetry ages out while it runs, and the archiver's segments plus what the streams still hold give
back every message the job published, at its sequence, byte for byte. `verify` is exact over it, the postmortem
equals the one from the messages as they were published, and an export and import carry all of it.

Issue 35: before the archive, the same drill's verify reported a divergence for every input that had aged out.
"""

import asyncio
import contextlib
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.job import JobCompleted
from flightdeck.events.store import Stored
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.audit.verify import verify
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.library import History, file_history, from_broker
from flightdeck.services.tools.postmortem.analysis import analyse
from flightdeck.services.tools.postmortem.report import blocks, markdown
from tests.e2e.drill_harness import crash_spec, start_drill, wait_lineage

pytestmark = pytest.mark.timeout(300)

LIMIT = 16 * 1024  # bytes each aging stream keeps: a few seconds of this drill's telemetry


async def follow(store: object, stream: str, wanted: str, into: list[Stored]) -> None:
    async for stored in store.follow(stream, [wanted]):  # type: ignore[attr-defined]
        into.append(stored)


async def test_a_drill_past_the_streams_limits_keeps_its_whole_history(
        nats_server: broker_mod.Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLIGHTDECK_TELEMETRY_MAX_BYTES", "FLIGHTDECK_LOGS_MAX_BYTES"):
        monkeypatch.setenv(name, str(LIMIT))
    monkeypatch.setenv("FLIGHTDECK_ARCHIVE_EVERY_S", "1")
    spec = crash_spec()
    job_id = f"{spec.name}-000001"
    p = await start_drill(nats_server.url, tmp_path)  # the services take the shrunk limits and the archive cadence
    published: dict[str, list[Stored]] = {subjects.TELEMETRY: [], subjects.LOGS: []}
    readers = [asyncio.create_task(follow(p.store, subjects.TELEMETRY, subjects.telemetry_job(job_id),
                                          published[subjects.TELEMETRY])),
               asyncio.create_task(follow(p.store, subjects.LOGS, subjects.logs_filter(job_id),
                                          published[subjects.LOGS]))]
    try:
        p.agent("n1", "--grace-s", "2")
        await p.ready("n1")
        await p.submit(spec, job_id)
        await p.until(lambda: bool(p.seen(JobCompleted, job_id)), 240, "the drill to complete", job_id)
        await wait_lineage(p, job_id, spec.train.steps)

        def finals() -> set[str]:
            return {ev.stream for ev in p.seen(HistoryArchived, job_id) if ev.final}

        await p.until(lambda: finals() == {subjects.TELEMETRY, subjects.LOGS}, 60, "the final segments", job_id)
    finally:
        for task in readers:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*readers)

    first, _, _ = await p.store.bounds(subjects.TELEMETRY)
    assert first > published[subjects.TELEMETRY][0].seq  # the job's first messages aged out of the stream
    records = p.seen(HistoryArchived, job_id)
    assert sum(r.count for r in records if r.stream == subjects.TELEMETRY) == len(published[subjects.TELEMETRY])
    assert not any(r.lost_to for r in records)  # archived before the limits dropped any of it

    history = await from_broker(nats_server.url, job_id, output=True, objects_url=p.objects.url)
    assert history.gaps == ()
    for stream, sent in published.items():
        assert sent, stream
        assert [(s.seq, s.subject, s.data) for s in history.stream(stream)] == \
            [(s.seq, s.subject, s.data) for s in sent], stream  # every message, at its sequence, byte for byte

    verdict = await verify(history.store, job_id)
    assert verdict.ok, verdict.divergences[:1]
    control = history.stream(subjects.CONTROL)
    as_published = [*control, *published[subjects.TELEMETRY], *history.stream(subjects.DEAD), *published[subjects.LOGS]]
    assert markdown(blocks(analyse(history.rows, job_id))) == markdown(blocks(analyse(as_published, job_id)))

    exported = tmp_path / f"{job_id}.fdh"
    exported.write_bytes(fdh.dumps(history.rows, job_id=job_id, source="test"))
    imported: History = file_history(exported, job_id)
    for stream in (subjects.CONTROL, subjects.TELEMETRY, subjects.LOGS):
        assert [(s.seq, s.data) for s in imported.stream(stream)] == [(s.seq, s.data) for s in history.stream(stream)]
    await p.close()
