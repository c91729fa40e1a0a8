"""A service restart's catch-up with and without a state snapshot, on one nats-server, in one run.

The history is bench/replay_speed.py's: one 4-rank job's steps and heartbeats on FD_TELEMETRY, the health
monitor's ticks (each recording its telemetry position) every 50 of them, checkpoints every 100 steps, the job's
lifecycle on FD_CONTROL. A service rebuilds to the end of it as its shell does at a start
(services/shell/runtime.py):

- refold: `flightdeck.services.shell.fold.rebuild` from the first event (every start before snapshots);
- snapshot: `services.shell.snapshots.load` of a snapshot written `--behind` inputs before the end (the most a
  restart folds with the default of one snapshot every 10,000 inputs), then `rebuild` from it to the end.

Both rebuild to the same position; the bench asserts they end in the same state (`snapshots.digest`). Reported per
history length and service: the median of `--rounds` alternated rounds of each, their ratio, the snapshot's size
and the time to take and write it.

    .venv/bin/python bench/state_snapshots.py                                  # 100k and 1M events
    .venv/bin/python bench/state_snapshots.py --events 100000 --rounds 1       # quick
"""

import argparse
import asyncio
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.replay_speed import config_without_fsync, history, populate
from flightdeck.events import subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.services import registry
from flightdeck.services.shell import broker, snapshots
from flightdeck.services.shell.fold import Folder, rebuild, replay

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-state-snapshots.json"
SERVICES = ("health",)  # the core that folds every telemetry message: the longest rebuild by far


async def snapshot_point(service_name: str, store: JetStreamStore, behind: int) -> tuple[int, int]:
    """The FD_CONTROL position `behind` of the service's inputs before the end, and how many it folds in all."""
    service = registry.build(service_name, env={})
    folder: Folder[Any] = Folder(service)
    marks: list[tuple[int, int]] = []  # (control seq, inputs folded through it)
    inputs = 0
    async for step in replay(service, store, folder=folder):
        inputs += 1
        if step.input.stream == subjects.CONTROL:
            marks.append((step.input.seq, inputs))
    cut = next((seq for seq, n in reversed(marks) if inputs - n >= behind), 0)
    return cut, inputs


async def timed_rebuild(service_name: str, store: JetStreamStore, until: int, *, from_snapshot: bool
                        ) -> tuple[float, float, str, int]:
    service = registry.build(service_name, env={})
    began, cpu = time.perf_counter(), time.process_time()
    start: Folder[Any] | None = None
    if from_snapshot:
        loaded = await snapshots.load(store, service)
        assert loaded is not None, "the snapshot did not load"
        start = loaded.folder
    at = start.control_seq if start is not None else 0
    folder = await rebuild(service, store, until=until, folder=start)
    return time.perf_counter() - began, time.process_time() - cpu, snapshots.digest(folder.state), at


async def one_length(events: int, rounds: int, behind: int) -> dict[str, Any]:
    items = history(events)
    out: dict[str, Any] = {"stored_events": len(items)}
    with tempfile.TemporaryDirectory(prefix="state-bench-") as tmp:
        server = broker.start(Path(tmp) / "nats", config=config_without_fsync(Path(tmp)))
        try:
            store = await JetStreamStore.connect(server.url, name="bench")
            t = time.perf_counter()
            await populate(store, items)
            out["populate_s"] = round(time.perf_counter() - t, 1)
            del items
            end = await store.last_seq(subjects.CONTROL)
            for name in SERVICES:
                cut, inputs = await snapshot_point(name, store, behind)
                service = registry.build(name, env={})
                at_cut = await rebuild(service, store, until=cut)
                t = time.perf_counter()
                taken = snapshots.take(at_cut, generation=0, now=time.time())
                take_s = time.perf_counter() - t
                t = time.perf_counter()
                await snapshots.write(store, taken)
                write_s = time.perf_counter() - t
                refold, from_snap, cpu_refold, cpu_snap = [], [], [], []
                digests = set()
                for _ in range(rounds):  # alternated: load from elsewhere on the box hits both alike
                    s, c, d, _ = await timed_rebuild(name, store, end, from_snapshot=False)
                    refold.append(s)
                    cpu_refold.append(c)
                    digests.add(d)
                    s, c, d, at = await timed_rebuild(name, store, end, from_snapshot=True)
                    assert at == cut, (at, cut)
                    from_snap.append(s)
                    cpu_snap.append(c)
                    digests.add(d)
                assert len(digests) == 1, "a rebuild from the snapshot ended in another state than the refold"
                r, f = statistics.median(refold), statistics.median(from_snap)
                out[name] = {"inputs_folded_by_a_refold": inputs, "snapshot_at_control_seq": cut,
                             "inputs_after_snapshot": behind, "snapshot_bytes": taken.head.size,
                             "take_s": round(take_s, 4), "write_s": round(write_s, 4),
                             "refold_s": r, "from_snapshot_s": f, "ratio": r / f,
                             "refold_all_s": refold, "from_snapshot_all_s": from_snap,
                             "refold_cpu_s": statistics.median(cpu_refold),
                             "from_snapshot_cpu_s": statistics.median(cpu_snap)}
            await store.close()
        finally:
            server.stop()
    return out


def take_at_scale(num_ranks: int, seconds: int = 20) -> dict[str, float]:
    """Taking a snapshot holds the service's loop: the health monitor's state after `seconds` of a healthy
    `num_ranks`-rank job at 1 Hz (tests/unit/health_synth.py), pickled as `snapshots.take` does, and read back."""
    from flightdeck.events.clock import ClockTick
    from flightdeck.events.spec import PolicySpec
    from flightdeck.services.health.core import NAME
    from tests.unit.health_synth import SERVICE, Cluster, steady_second

    c = Cluster(num_ranks=num_ranks, policy=PolicySpec(straggler_window=3))
    c.start()
    folder: Folder[Any] = Folder(SERVICE)
    state = SERVICE.initial
    for ev in c.events:
        state, _ = SERVICE.transition(state, ev)
    for s in range(seconds):
        for ev in steady_second(c.job_id, num_ranks, s):
            state, _ = SERVICE.transition(state, ev)
        state, _ = SERVICE.transition(state, ClockTick(service=NAME, now=s + 1.0, positions={}, event_id=f"t{s}",
                                                       occurred_at=s + 1.0))
    folder.state = state
    t = time.perf_counter()
    taken = snapshots.take(folder, generation=0, now=0.0)
    take_s = time.perf_counter() - t
    t = time.perf_counter()
    pickle.loads(b"".join(taken.parts))
    return {"ranks": num_ranks, "bytes": taken.head.size, "take_s": take_s, "load_s": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", default="100000,1000000", help="history lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--behind", type=int, default=snapshots.EVERY, help="inputs between the snapshot and the end")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    command = " ".join([".venv/bin/python", *sys.argv])
    results: dict[str, Any] = {
        "benchmark": "a service's rebuild at a restart: from the first event vs from a state snapshot",
        "command": command, "lengths": []}
    print(f"command: {command}")
    print(f"{'events':>10} {'service':<10} {'inputs':>10} {'refold s':>9} {'snapshot s':>10} {'ratio':>7} "
          f"{'snap MB':>8} {'take+write s':>12}")
    for events in (int(e) for e in args.events.split(",")):
        row = asyncio.run(one_length(events, args.rounds, args.behind))
        results["lengths"].append(row)
        for name in SERVICES:
            r = row[name]
            print(f"{row['stored_events']:>10,} {name:<10} {r['inputs_folded_by_a_refold']:>10,} "
                  f"{r['refold_s']:>9.2f} {r['from_snapshot_s']:>10.3f} {r['ratio']:>6.1f}x "
                  f"{r['snapshot_bytes'] / 1e6:>8.2f} {r['take_s'] + r['write_s']:>12.3f}", flush=True)
    scale = take_at_scale(4096)
    results["health_4096_ranks"] = scale
    print(f"health state of a 4,096-rank job: {scale['bytes'] / 1e6:.2f} MB, taken in {scale['take_s']:.3f} s "
          f"(the service's loop waits that long), unpickled in {scale['load_s']:.3f} s")
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
