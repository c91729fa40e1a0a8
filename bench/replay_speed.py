"""Replay speed: `flightdeck replay`'s path over a long job history (telemetry included) against a raw nats-py
read of the same messages, in one run on one nats-server.

    .venv/bin/python bench/replay_speed.py                        # 300k events, 3 rounds, medians
    .venv/bin/python bench/replay_speed.py --events 1000000 --rounds 1 --out bench/results/cpu-replay-speed.json

The history is one 4-rank job: every step a StepCompleted and a Heartbeat per rank on FD_TELEMETRY, a health
ClockTick (recording its telemetry position) every 50 telemetry messages, checkpoints every 100 steps, the
job's lifecycle on FD_CONTROL; a second job's telemetry (a tenth of the stream) that the replay filters out.

- ours: `services.tools.history.read.job_rows` (the batched reader of events/jsreader.py, events decoded once with
  the reused msgspec decoder) -> `History` (the read-only store over the rows) -> the replay fold
  (`replay_cmd.replayed`: the job's state at the end and its timeline);
- raw: nats-py ordered consumers with a callback (its fastest documented path) over the same selection,
  each message turned into the same record the store returns (flightdeck.events.store.decoded: the same decoder, the
  sequence from the message's metadata, the msg id from its headers), kept in a list; no fold at all.

Goal: ours / raw >= 1.0 in events per second. Populating skips `sync_interval: always` (fsync does not change
how fast reads are, and 1M fsynced appends take minutes here).
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import nats
from nats.aio.msg import Msg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition
from flightdeck.events.clock import ClockTick
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import (
    AllocationGranted,
    AllocationRequested,
    JobCompleted,
    JobQueued,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import Stored, decoded
from flightdeck.events.training import Heartbeat, StepCompleted
from flightdeck.services.shell import broker
from flightdeck.services.tools.console.replay_cmd import replayed
from flightdeck.services.tools.history import History
from flightdeck.services.tools.history.read import job_rows

JOB, OTHER, RANKS = "bench-000001", "other-000002", 4
T0 = 1.7e9


class Plan:
    """What to append, in the order the live system would have: a list per batch, control and telemetry mixed."""

    def __init__(self, events: int) -> None:
        self.items: list[tuple[str, Event]] = []
        self.version = 0
        self.telemetry = 0  # telemetry messages appended so far: the tick positions
        self.events = events

    def job(self, event: Event) -> None:
        self.version += 1
        self.items.append((subjects.job(JOB, type(event).__name__), _with_version(event, self.version)))

    def tel(self, job: str, event: Event, rank: int) -> None:
        self.telemetry += 1
        self.items.append((subjects.telemetry(job, rank, type(event).__name__), event))
        if self.telemetry % 50 == 0:
            self.items.append((subjects.clock("health"), ClockTick(
                service="health", now=event.occurred_at, occurred_at=event.occurred_at,
                positions={subjects.TELEMETRY: self.telemetry}, event_id=f"tick-{self.telemetry}")))


def _with_version(event: Event, version: int) -> Event:
    return msgspec.structs.replace(event, job_version=version, event_id=f"{JOB}-{version}")


def history(events: int) -> list[tuple[str, Event]]:
    p = Plan(events)
    slots = [SlotRef(node="n1", slot=r, rank=r) for r in range(RANKS)]
    p.job(JobSubmitted(job_id=JOB, occurred_at=T0, spec=JobSpec(name="bench", slots=RANKS)))
    p.job(JobQueued(job_id=JOB, occurred_at=T0, priority=50, reason="submitted"))
    p.job(AllocationRequested(job_id=JOB, occurred_at=T0, slots=RANKS, attempt=0))
    p.job(AllocationGranted(job_id=JOB, occurred_at=T0 + 1, attempt=0, assignments=slots))
    p.job(WorkersStarted(job_id=JOB, occurred_at=T0 + 2, node="n1", attempt=0, ranks=list(range(RANKS)),
                         pids=list(range(RANKS))))
    step = 0
    while len(p.items) < events - 1:
        at = T0 + 3 + step * 0.1
        for rank in range(RANKS):
            p.tel(JOB, StepCompleted(job_id=JOB, rank=rank, occurred_at=at, step=step, loss=3.0 / (1 + step / 1000),
                                     grad_norm=1.0, lr=3e-4, tokens_per_s=1e5, step_time_s=0.1,
                                     event_id=f"s{step}-{rank}"), rank)
            p.tel(JOB, Heartbeat(job_id=JOB, rank=rank, occurred_at=at, step=step, interval_s=1.0,
                                 event_id=f"h{step}-{rank}"), rank)
        if step % 2 == 0:
            p.tel(OTHER, StepCompleted(job_id=OTHER, rank=0, occurred_at=at, step=step, loss=2.0, grad_norm=1.0,
                                       lr=3e-4, tokens_per_s=1e5, step_time_s=0.1, event_id=f"o{step}"), 0)
        if step % 100 == 99:
            p.job(CheckpointCommitted(job_id=JOB, occurred_at=at, checkpoint_id=f"step{step:09}-a0", step=step,
                                      world_size=RANKS, uri="file:///o/m.json", bytes=1 << 20,
                                      data=DataPosition(next_batch=step + 1)))
        step += 1
    p.job(JobCompleted(job_id=JOB, occurred_at=T0 + 4 + step * 0.1, steps=step))
    return p.items


def selection_size(items: list[tuple[str, Event]]) -> tuple[int, int]:
    """How many messages a replay of JOB reads: all control, the job's telemetry."""
    control = sum(1 for s, _ in items if s.startswith("fd.ctl."))
    return control, sum(1 for s, _ in items if s.startswith(f"fd.tel.{JOB}."))


async def populate(store: JetStreamStore, items: list[tuple[str, Event]]) -> None:
    for i in range(0, len(items), 5000):
        await store.append_batch(items[i : i + 5000])


async def ours(store: JetStreamStore, n: int) -> tuple[float, float, str]:
    start, cpu = time.perf_counter(), time.process_time()
    rows = await job_rows(store, JOB)
    result = replayed(History(job_id=JOB, rows=rows, source="bench"), None)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert len(rows) == n, (len(rows), n)
    assert result.state.phase == "completed", result.state.phase
    return elapsed, cpu, f"{result.state.phase}, {len(result.timeline)} timeline entries, step {result.state.step}"


async def raw(url: str, control: int, n: int) -> tuple[float, float]:
    """nats-py's ordered push consumer with a callback that decodes every message, per stream in turn."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    events: list[Stored] = []
    start, cpu = time.perf_counter(), time.process_time()
    for stream, subject in ((subjects.CONTROL, "fd.ctl.>"), (subjects.TELEMETRY, subjects.telemetry_job(JOB))):
        want = control if stream == subjects.CONTROL else n
        done = asyncio.Event()

        async def on_msg(msg: Msg, want: int = want, done: asyncio.Event = done, stream: str = stream) -> None:
            # the same record the store's reader builds (flightdeck.events.store.decoded), from nats-py's own parsing
            headers = msg.headers or {}
            events.append(decoded(stream, msg.metadata.sequence.stream, msg.subject, msg.data,
                                  headers.get("Nats-Msg-Id", "")))
            if len(events) >= want:
                done.set()

        sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, cb=on_msg, pending_msgs_limit=-1,
                                 pending_bytes_limit=-1)
        await done.wait()
        await sub.unsubscribe()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    await nc.close()
    assert len(events) == n, (len(events), n)
    return elapsed, cpu


def config_without_fsync(tmp: Path) -> Path:
    path = tmp / "server.conf"
    path.write_text(broker.CONFIG.read_text().replace("sync_interval: always", ""))
    return path


async def run(events: int, rounds: int) -> dict[str, object]:
    items = history(events)
    control, telemetry = selection_size(items)
    n = control + telemetry
    with tempfile.TemporaryDirectory(prefix="replay-bench-") as tmp:
        server = broker.start(Path(tmp) / "nats", config=config_without_fsync(Path(tmp)))
        try:
            store = await JetStreamStore.connect(server.url, name="bench")
            t = time.perf_counter()
            await populate(store, items)
            populate_s = time.perf_counter() - t
            raw_s, ours_s, raw_cpu, ours_cpu, said = [], [], [], [], ""
            for _ in range(rounds):  # alternate, so load from elsewhere on the box hits both alike
                took, cpu = await raw(server.url, control, n)
                raw_s.append(took)
                raw_cpu.append(cpu)
                took, cpu, said = await ours(store, n)
                ours_s.append(took)
                ours_cpu.append(cpu)
            await store.close()
        finally:
            server.stop()
    r, o = statistics.median(raw_s), statistics.median(ours_s)
    rc, oc = statistics.median(raw_cpu), statistics.median(ours_cpu)
    return {"stored_events": len(items), "replayed_events": n, "rounds": rounds, "populate_s": populate_s,
            "raw_nats_py_ordered_consumer_decode": {"median_s": r, "events_per_s": n / r, "all_s": raw_s,
                                                    "client_cpu_median_s": rc, "client_cpu_all_s": raw_cpu},
            "replay_read_decode_fold": {"median_s": o, "events_per_s": n / o, "all_s": ours_s, "result": said,
                                        "client_cpu_median_s": oc, "client_cpu_all_s": ours_cpu},
            "ratio_replay_vs_raw": r / o,
            "paired_ratios": [a / b for a, b in zip(raw_s, ours_s, strict=True)],  # each round's raw / ours
            # client CPU seconds: steadier than wall time on a shared box (the server's CPU is not in it)
            "ratio_client_cpu": rc / oc,
            "goal": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=300_000, help="messages stored (both streams, both jobs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args()
    result = asyncio.run(run(args.events, args.rounds))
    result["command"] = " ".join([".venv/bin/python", *sys.argv])
    print(f"command: {result['command']}")
    print(f"{result['replayed_events']:,} of {result['stored_events']:,} stored events replayed")
    print(f"{'reader':<38}{'median s':>10}{'events/s':>12}")
    for name in ("raw_nats_py_ordered_consumer_decode", "replay_read_decode_fold"):
        row = result[name]
        assert isinstance(row, dict)
        print(f"{name:<38}{row['median_s']:>10.2f}{row['events_per_s']:>12,.0f}")
    paired = result["paired_ratios"]
    assert isinstance(paired, list)
    print(f"replay / raw: {result['ratio_replay_vs_raw']:.2f}x of the medians, rounds "
          f"{', '.join(f'{x:.2f}x' for x in paired)} (goal >= 1.0x)")
    print(f"client CPU: raw {result['raw_nats_py_ordered_consumer_decode']['client_cpu_median_s']:.2f} s, "  # type: ignore[index]
          f"replay {result['replay_read_decode_fold']['client_cpu_median_s']:.2f} s: "  # type: ignore[index]
          f"{result['ratio_client_cpu']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
