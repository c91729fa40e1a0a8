"""What one fence costs when many writers race it: `append_to_job` of node records (WorkersStarted) into one job's
history on the shipped nats-server config (sync_interval: always), one writer after another against many at once.
This is why a node agent's records now stand outside the fence (events/history.py); the last row is how they are
stored today, for the same number of writers.

    python bench/fence_contention.py                   # 512 appends; 1 writer, 4 writers, 128 at once
    python bench/fence_contention.py --appends 1024 --concurrent 256

Each fenced append reads the job's last message and appends expecting it; a writer that lost the race reads again,
so concurrent writers multiply requests instead of sharing the work.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sim import platform as plat
from flightdeck.events import subjects
from flightdeck.events.history import append_to_job, version_of
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import WorkersStarted
from flightdeck.events.store import ConcurrencyConflict
from flightdeck.services.shell.logging import configure


def record(job: str, k: int) -> WorkersStarted:
    return WorkersStarted(job_id=job, node=f"n{k}", attempt=0, ranks=[k], pids=[k], event_id=f"{job}-{k}",
                          occurred_at=time.time(), producer="bench")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--appends", type=int, default=512)
    ap.add_argument("--concurrent", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    configure("WARNING")
    root = Path(tempfile.mkdtemp(prefix="fence-"))
    p = plat.start_broker(root)
    try:
        stores = [await JetStreamStore.connect(p.broker.url, name=f"w{i}") for i in range(4)]

        async def versioned(store: JetStreamStore, ev: WorkersStarted) -> None:
            # As append_to_job stored node records before: a versioned event under the job's fence.
            fence = f"fd.ctl.job.{ev.job_id}.>"
            while True:
                last = await store.last(subjects.CONTROL, fence)
                version = version_of(last) + 1 if last is not None else 1
                try:
                    await store.append(subjects.job(ev.job_id, "WorkersStarted"),
                                       msgspec.structs.replace(ev, job_version=version), msg_id=ev.event_id,
                                       expected_last_seq=last.seq if last is not None else 0, fence=fence)
                    return
                except ConcurrencyConflict:  # another writer went first: read again
                    continue

        async def node_record(store: JetStreamStore, ev: WorkersStarted) -> None:
            await append_to_job(store, ev)  # today: under the node's subject, unfenced

        async def timed(job: str, writers: int, way: Callable[[JetStreamStore, WorkersStarted], Awaitable[None]],
                        n: int) -> float:
            async def writer(w: int) -> None:
                for k in range(w, n, writers):
                    await way(stores[w % len(stores)], record(job, k))

            t = time.perf_counter()
            await asyncio.gather(*(writer(w) for w in range(writers)))
            return (time.perf_counter() - t) / n * 1000

        n, c = args.appends, args.concurrent
        rows = {
            "fenced, 1 writer": await timed("a", 1, versioned, n),
            "fenced, 4 writers": await timed("b", 4, versioned, n),
            f"fenced, {c} writers at once": await timed("c", c, versioned, c),
            f"node records (today), {c} writers at once": await timed("d", c, node_record, c),
        }
        for s in stores:
            await s.close()
    finally:
        p.stop()
    result = {"appends": n, "concurrent": c, "ms_per_append": {k: round(v, 2) for k, v in rows.items()},
              "load_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
