"""Reading a long history: `JetStreamStore.read` against a raw nats-py ordered consumer decoding the same
messages (each run reads the whole of FD_CONTROL; the store also returns sequence, subject and msg id).

    .venv/bin/python bench/read_history.py                   # 200k control events, 3 rounds, medians
    .venv/bin/python bench/read_history.py --events 50000 --rounds 5

It starts its own nats-server in a temp dir. Populating uses a copy of infra/nats/server.conf without
`sync_interval: always` (200k fsynced appends take minutes here and do not change how fast reads are).
Goal: store / raw >= 1.0.
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
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import codec, subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationRequested, JobQueued, WorkersExited
from flightdeck.services.shell import broker


def history(n: int, jobs: int = 100) -> list[tuple[str, Event]]:
    """A control stream's mix: job lifecycle events over `jobs` jobs, and a clock tick every tenth event."""
    out: list[tuple[str, Event]] = []
    for i in range(n):
        job, v = f"job-{i % jobs}", i // jobs + 1
        if i % 10 == 9:
            out.append((subjects.clock("scheduler"), ClockTick(service="scheduler", now=1.7e9 + i,
                                                                positions={"FD_TELEMETRY": i}, event_id=f"t{i}")))
            continue
        kind = i % 3
        event: Event
        if kind == 0:
            event = JobQueued(job_id=job, job_version=v, priority=50, reason="submitted", event_id=f"e{i}")
        elif kind == 1:
            event = AllocationRequested(job_id=job, job_version=v, slots=2, attempt=1, event_id=f"e{i}")
        else:
            event = WorkersExited(job_id=job, job_version=v, node="n1", attempt=1, rank=0, exit_code=0,
                                  event_id=f"e{i}", occurred_at=1.7e9 + i, producer="agent")
        out.append((subjects.job(job, type(event).__name__), event))
    return out


async def populate(store: JetStreamStore, items: list[tuple[str, Event]]) -> None:
    for i in range(0, len(items), 5000):
        await store.append_batch(items[i : i + 5000])


async def read_store(store: JetStreamStore, n: int) -> float:
    start = time.perf_counter()
    got = 0
    async for batch in store.read(subjects.CONTROL):
        got += len(batch)
    elapsed = time.perf_counter() - start
    assert got == n, (got, n)
    return elapsed


async def read_raw(url: str, n: int) -> float:
    """The baseline: nats-py's ordered push consumer with a callback that decodes every message."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    events: list[Event] = []
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        events.append(codec.decode(msg.data))
        if len(events) == n:
            done.set()

    start = time.perf_counter()
    sub = await js.subscribe(">", stream=subjects.CONTROL, ordered_consumer=True, cb=on_msg,
                             pending_msgs_limit=-1, pending_bytes_limit=-1)
    await done.wait()
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    await nc.close()
    return elapsed


def config_without_fsync(tmp: Path) -> Path:
    text = broker.CONFIG.read_text().replace("sync_interval: always", "")
    path = tmp / "server.conf"
    path.write_text(text)
    return path


async def run(n: int, rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="read-bench-") as tmp:
        server = broker.start(Path(tmp) / "nats", config=config_without_fsync(Path(tmp)))
        try:
            store = await JetStreamStore.connect(server.url, name="bench")
            t = time.perf_counter()
            await populate(store, history(n))
            populate_s = time.perf_counter() - t
            raw_s, store_s = [], []
            for _ in range(rounds):  # alternate, so load from elsewhere on the box hits both alike
                raw_s.append(await read_raw(server.url, n))
                store_s.append(await read_store(store, n))
            await store.close()
        finally:
            server.stop()
    raw, ours = statistics.median(raw_s), statistics.median(store_s)
    return {"events": n, "rounds": rounds, "populate_s": populate_s,
            "raw_ordered_consumer": {"median_s": raw, "events_per_s": n / raw, "all_s": raw_s},
            "store_read": {"median_s": ours, "events_per_s": n / ours, "all_s": store_s},
            "ratio_store_vs_raw": raw / ours, "goal": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args()
    result = asyncio.run(run(args.events, args.rounds))
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'reader':<28}{'median s':>10}{'events/s':>12}")
    for name in ("raw_ordered_consumer", "store_read"):
        row = result[name]
        assert isinstance(row, dict)
        print(f"{name:<28}{row['median_s']:>10.2f}{row['events_per_s']:>12,.0f}")
    print(f"store / raw: {result['ratio_store_vs_raw']:.2f}x (goal >= 1.0x)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
