"""What the archive costs and gives back: one job's telemetry (StepCompleted and RankHeartbeats of 8 ranks, beside
another job's) archived from a real nats-server into a local object store by the archiver's effect, then read
back as readers do: from the segments, against reading the same messages from the live stream (the baseline,
measured in the same run).

    .venv/bin/python bench/archive_history.py                      # 200k messages, segments of 20k, 3 rounds
    .venv/bin/python bench/archive_history.py --messages 50000 --segment 5000

Reported: archive throughput (messages/s), stored bytes against the stream's bytes, and the read time from the
segments against the stream's (ratio). It starts its own nats-server (without per-append fsync, as
bench/read_history.py) in a temp dir.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.read_history import config_without_fsync
from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.base import Event
from flightdeck.events.heartbeats import RankBeat, RankHeartbeats
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.training import StepCompleted
from flightdeck.services.archiver.core import Ask
from flightdeck.services.archiver.service import archive
from flightdeck.services.shell import broker
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.tools.history.archived import stream_rows

JOB, OTHER, RANKS = "bench-000001", "other-000001", 8


def telemetry(n: int) -> list[tuple[str, Event]]:
    """`n` messages: per step each rank's StepCompleted and one heartbeat batch, a tenth of them another job's."""
    out: list[tuple[str, Event]] = []
    step = 0
    while len(out) < n:
        job = OTHER if step % 10 == 9 else JOB
        for rank in range(RANKS):
            out.append((subjects.telemetry(job, rank, "StepCompleted"), StepCompleted(
                job_id=job, rank=rank, attempt=0, node=f"n{rank // 4}", step=step, loss=2.0 - step * 1e-5,
                grad_norm=1.0, lr=3e-4, tokens_per_s=1e5, step_time_s=0.1, event_id=f"{job}-{step}-{rank}",
                occurred_at=1.7e9 + step)))
        beats = [RankBeat(rank=r, step=step, occurred_at=1.7e9 + step, step_time_s=0.1) for r in range(RANKS)]
        out.append((subjects.telemetry(job, 0, "RankHeartbeats"), RankHeartbeats(
            job_id=job, rank=0, attempt=0, node="n0", interval_s=1.0, beats=beats, event_id=f"{job}-b{step}",
            occurred_at=1.7e9 + step)))
        step += 1
    return out[:n]


async def archive_all(store: JetStreamStore, objects: LocalStore, last: int, every: int) -> list[HistoryArchived]:
    """The job archived as the archiver would after each `every` messages: one segment per ask."""
    records: list[HistoryArchived] = []
    start = 0
    for until in [*range(every, last, every), last]:
        view = _Upto(store, until)
        out = await archive(view, objects, Ask(job_id=JOB, stream=subjects.TELEMETRY, from_seq=start,  # type: ignore[arg-type]
                                                final=until == last, submitted_at=0.0))
        for emit in out:
            assert isinstance(emit.event, HistoryArchived)
            records.append(emit.event)
            start = emit.event.last_seq + 1
    return records


class _Upto:
    """The store as it stood when the stream ended at `until`: what an ask at that time reads."""

    def __init__(self, store: JetStreamStore, until: int) -> None:
        self.store, self.until = store, until

    async def bounds(self, stream: str) -> tuple[int, float, int]:
        first, at, _ = await self.store.bounds(stream)
        return first, at, self.until

    def read(self, *args: object, **kwargs: object) -> object:
        return self.store.read(*args, **kwargs)  # type: ignore[arg-type]


async def read_live(store: JetStreamStore) -> tuple[float, int]:
    start = time.perf_counter()
    got = 0
    async for batch in store.read(subjects.TELEMETRY, [subjects.telemetry_job(JOB)]):
        got += len(batch)
    return time.perf_counter() - start, got


async def read_archived(store: JetStreamStore, objects: LocalStore,
                        records: list[HistoryArchived]) -> tuple[float, int]:
    start = time.perf_counter()
    rows, gaps = await stream_rows(store, objects, JOB, subjects.TELEMETRY, records, 0.0)
    assert not gaps, gaps
    return time.perf_counter() - start, len(rows)


async def run(n: int, every: int, rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="archive-bench-") as tmp:
        server = broker.start(Path(tmp) / "nats", config=config_without_fsync(Path(tmp)))
        try:
            store = await JetStreamStore.connect(server.url, name="bench")
            items = telemetry(n)
            for i in range(0, len(items), 5000):
                await store.append_batch(items[i : i + 5000])
            info = await store.js.stream_info(subjects.TELEMETRY)
            objects = LocalStore(Path(tmp) / "objects")
            t = time.perf_counter()
            records = await archive_all(store, objects, info.state.last_seq, every)
            archive_s = time.perf_counter() - t
            mine = sum(r.count for r in records)
            live_s, archived_s = [], []
            for _ in range(rounds):  # alternate, so load from elsewhere on the box hits both alike
                s, got = await read_live(store)
                assert got == mine, (got, mine)
                live_s.append(s)
                s, got = await read_archived(store, objects, records)
                assert got == mine, (got, mine)
                archived_s.append(s)
            await store.close()
        finally:
            server.stop()
    live, archived = statistics.median(live_s), statistics.median(archived_s)
    return {"messages": n, "job_messages": mine, "segments": len(records), "stream_bytes": info.state.bytes,
            "segment_bytes": sum(r.bytes for r in records), "archive_s": archive_s,
            "archive_messages_per_s": n / archive_s, "read_live": {"median_s": live, "all_s": live_s},
            "read_archived": {"median_s": archived, "all_s": archived_s}, "archived_vs_live": archived / live}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--segment", type=int, default=20_000, help="stream messages between asks (one segment each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args()
    r = asyncio.run(run(args.messages, args.segment, args.rounds))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"archived {r['job_messages']:,} of {r['messages']:,} messages in {r['segments']} segments: "
          f"{r['archive_s']:.2f} s ({r['archive_messages_per_s']:,.0f} stream messages/s)")
    print(f"stored {r['segment_bytes']:,} bytes for a stream of {r['stream_bytes']:,} (both jobs)")
    live, archived = r["read_live"], r["read_archived"]
    assert isinstance(live, dict) and isinstance(archived, dict)
    print(f"the job's telemetry read: stream {live['median_s']:.2f} s, segments {archived['median_s']:.2f} s "
          f"({r['archived_vs_live']:.2f}x the stream's time)")
    if args.out:
        args.out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
