"""Appending many events: `JetStreamStore.append_batch` against raw nats-py `publish_async` of the same
encoded events with the same Nats-Msg-Id headers, on the same server, in the same batch sizes.

    .venv/bin/python bench/append_throughput.py                      # server config as shipped (fsync always)
    .venv/bin/python bench/append_throughput.py --no-fsync           # without sync_interval: always
    .venv/bin/python bench/append_throughput.py --events 20000 --batch 500 --rounds 5

It starts its own nats-server in a temp dir; telemetry events (StepCompleted) into FD_TELEMETRY.
Goal: store / raw >= 0.8.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import codec, subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker


def steps(n: int, tag: str) -> list[tuple[str, StepCompleted]]:
    return [(subjects.telemetry("bench", i % 8, "StepCompleted"),
             StepCompleted(job_id="bench", rank=i % 8, attempt=1, node="n1", step=i, loss=2.5 - i * 1e-5,
                           grad_norm=0.9, lr=3e-4, tokens_per_s=12345.0, step_time_s=0.21,
                           event_id=f"{tag}-{i}", occurred_at=1.7e9 + i, producer="trainer"))
            for i in range(n)]


async def append_store(store: JetStreamStore, items: list[tuple[str, StepCompleted]], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        results = await store.append_batch(items[i : i + batch])
        assert not any(r.duplicate for r in results)
    return time.perf_counter() - start


async def append_raw(url: str, items: list[tuple[str, StepCompleted]], batch: int) -> float:
    """The baseline: encode, publish_async with the msg id header, gather the acks, per batch."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        futures = [await js.publish_async(subject, codec.encode(event), headers={"Nats-Msg-Id": event.event_id})
                   for subject, event in items[i : i + batch]]
        acks = await asyncio.gather(*futures)
        assert not any(a.duplicate for a in acks)
    elapsed = time.perf_counter() - start
    await nc.close()
    return elapsed


async def run(n: int, batch: int, rounds: int, fsync: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="append-bench-") as tmp:
        config = broker.CONFIG
        if not fsync:
            config = Path(tmp) / "server.conf"
            config.write_text(broker.CONFIG.read_text().replace("sync_interval: always", ""))
        server = broker.start(Path(tmp) / "nats", config=config)
        try:
            store = await JetStreamStore.connect(server.url, name="bench")
            await append_store(store, steps(min(n, 2000), "warm"), batch)
            raw_s, store_s = [], []
            for r in range(rounds):  # alternate, so load from elsewhere on the box hits both alike
                raw_s.append(await append_raw(server.url, steps(n, f"raw{r}"), batch))
                store_s.append(await append_store(store, steps(n, f"store{r}"), batch))
            await store.close()
        finally:
            server.stop()
    raw, ours = statistics.median(raw_s), statistics.median(store_s)
    return {"events": n, "batch": batch, "rounds": rounds, "fsync_always": fsync,
            "raw_publish_async": {"median_s": raw, "events_per_s": n / raw, "all_s": raw_s},
            "store_append_batch": {"median_s": ours, "events_per_s": n / ours, "all_s": store_s},
            "ratio_store_vs_raw": raw / ours, "goal": 0.8}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-fsync", action="store_true", help="drop `sync_interval: always` from the server config")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args()
    result = asyncio.run(run(args.events, args.batch, args.rounds, not args.no_fsync))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'writer':<28}{'median s':>10}{'events/s':>12}")
    for name in ("raw_publish_async", "store_append_batch"):
        row = result[name]
        assert isinstance(row, dict)
        print(f"{name:<28}{row['median_s']:>10.2f}{row['events_per_s']:>12,.0f}")
    print(f"store / raw: {result['ratio_store_vs_raw']:.2f}x (goal >= 0.8x); fsync always: {result['fsync_always']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
