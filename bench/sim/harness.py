"""One scale run: the real services and broker, `num_ranks` simulated ranks in a few processes, a steady window
measured (the health monitor's ingest and CPU), then ranks killed one at a time and each one's detection timed
(its last heartbeat -> the RankLost on the bus). Every RankLost restarts the job (the scheduler's recipe), so
each kill is measured on a fresh attempt, after the restart has settled."""

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog

from bench.sim import platform as plat
from bench.sim import worker
from bench.sim.ranks import Mode, Timing
from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import Finding, RankLost
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.spec import PolicySpec

log = structlog.get_logger("flightdeck.sim")
SERVICES = ("health", "scheduler", "resources")
FINDINGS = ("RankLost", "RankHung", "StragglerDetected", "NonFiniteLoss", "LossSpikeDetected")
RESTART_RECORDS = ("AllocationRequested", "AllocationGranted", "WorkersExited", "WorkersStarted", "JobResumed")


def breakdown(arrivals: list[tuple[float, str, int]], since: float, attempt: int) -> dict[str, float]:
    """Seconds from the RankLost being seen to the first and last of each of the restart's records (the old
    attempt's exits, the new attempt's request, grant, starts and JobResumed), as the harness saw them stored."""
    out: dict[str, float] = {}
    for at, name, a in arrivals:
        if at < since or a != (attempt if name == "WorkersExited" else attempt + 1):
            continue
        first, last = f"{name}_first_s", f"{name}_last_s"
        out.setdefault(first, round(at - since, 3))
        out[last] = round(at - since, 3)
    return out


@dataclass(frozen=True)
class RunConfig:
    num_ranks: int
    mode: Mode = "node"
    kills: int = 10
    processes: int = 0  # 0: one per 1,024 ranks, 2 to 4
    window_s: float = 20.0  # steady-state measurement
    settle_s: float = 8.0  # after the ranks (re)start, before measuring or killing
    beat_s: float = 1.0
    misses: int = 5
    step_s: float = 2.0
    tick_s: float = 1.0  # the health monitor's FLIGHTDECK_HEALTH_TICK_S
    kill_timeout_s: float = 90.0
    seed: int = 0

    @property
    def threshold_s(self) -> float:
        return self.beat_s * self.misses


@dataclass
class Hub:
    """What the worker processes report, read on the harness's loop."""

    conns: list[Connection]
    started: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # attempt -> nodes started
    stats: dict[int, dict[str, float]] = field(default_factory=dict)
    killed: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (rank, attempt) -> times
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def attach(self) -> None:
        loop = asyncio.get_running_loop()
        for i, conn in enumerate(self.conns):
            loop.add_reader(conn.fileno(), self._read, i, conn)

    def detach(self) -> None:
        loop = asyncio.get_running_loop()
        for conn in self.conns:
            loop.remove_reader(conn.fileno())

    def _read(self, i: int, conn: Connection) -> None:
        while conn.poll():
            try:
                msg: tuple[Any, ...] = conn.recv()
            except EOFError:
                asyncio.get_running_loop().remove_reader(conn.fileno())
                return
            match msg:
                case ("started", attempt, n):
                    self.started[attempt] += n
                case ("stats", counters):
                    self.stats[i] = counters
                case ("killed", rank, attempt, last_beat, at):
                    self.killed[(rank, attempt)] = (last_beat, at)
        self.changed.set()

    def total(self, key: str) -> float:
        return sum(s.get(key, 0.0) for s in self.stats.values())

    async def until(self, check: Any, within: float, what: str) -> None:
        deadline = time.monotonic() + within
        while not check():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {within:.0f}s waiting for {what}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.5))


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else float("nan")


class Cpu:
    """CPU seconds of named processes between two readings."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0, self.c0 = time.monotonic(), self._read()

    def _read(self) -> dict[str, float]:
        return {n: plat.cpu_seconds(p) for n, p in self.pids.items()}

    def percent(self) -> dict[str, float]:
        wall, now = time.monotonic() - self.t0, self._read()
        return {n: round(100 * (now[n] - self.c0[n]) / wall, 1) for n in self.pids}


async def health_ticks(store: JetStreamStore, since: float) -> list[ClockTick]:
    ticks = []
    async for batch in store.read(subjects.CONTROL, [subjects.clock("health")]):
        ticks += [s.event for s in batch if isinstance(s.event, ClockTick) and s.event.now >= since]
    return ticks


def _round(x: float, digits: int = 0) -> float | None:
    """None when the health monitor folded under two ticks in the window (it fell behind)."""
    return round(x, digits) if x == x else None


async def caught_up(store: JetStreamStore, deadline: float) -> float:
    """Wait until the health monitor has folded everything in FD_CONTROL (a restart appends two records per
    node, which every service folds one at a time); returns how long that took."""
    began = time.time()
    while time.time() < deadline:
        info = await store.js.consumer_info(subjects.CONTROL, "service-health")
        if not info.num_pending and not info.num_ack_pending:
            return time.time() - began
        await asyncio.sleep(0.5)
    raise TimeoutError("the health monitor did not catch up with FD_CONTROL")


async def run(config: RunConfig, root: Path) -> dict[str, Any]:
    c = config
    nodes = plat.node_names(c.num_ranks)
    procs_n = c.processes or max(2, min(4, c.num_ranks // 1024))
    job_id = f"sim-{c.num_ranks}"
    policy = PolicySpec(heartbeat_interval_s=c.beat_s, heartbeat_misses=c.misses, hang_min_s=120.0, max_restarts=1000,
                        straggler_window=20)
    p = plat.start_broker(root)
    store = await JetStreamStore.connect(p.broker.url, name="scale-sim")
    workers: list[Any] = []
    hub: Hub | None = None
    try:
        plat.start_services(p, SERVICES, FLIGHTDECK_HEALTH_TICK_S=str(c.tick_s))
        await plat.register_fleet(store, nodes)
        ctx = mp.get_context("spawn")
        conns = []
        for w in range(procs_n):
            mine, theirs = ctx.Pipe()
            cfg = worker.WorkerConfig(url=p.broker.url, job_id=job_id, nodes=tuple(nodes[w::procs_n]), mode=c.mode,
                                      timing=Timing(beat_s=c.beat_s, step_s=c.step_s), seed=c.seed * 100 + w)
            proc = ctx.Process(target=worker.main, args=(cfg, theirs), daemon=True)
            proc.start()
            workers.append(proc)
            conns.append(mine)
        hub = Hub(conns)
        hub.attach()
        findings: list[tuple[float, Finding]] = []
        arrivals: list[tuple[float, str, int]] = []  # (seen at, type, attempt) of a restart's records

        async def follow_findings() -> None:
            # Only what FD_CONTROL stored: a core subscription would also see appends the fence refused.
            # A follow that fails (a restart floods the stream) starts again after the last finding read.
            seq = 1
            while True:
                try:
                    patterns = [*(f"fd.ctl.job.{job_id}.{t}" for t in (*FINDINGS, *RESTART_RECORDS)),
                                *(f"fd.ctl.job.{job_id}.node.*.{t}" for t in sorted(subjects.NODE_RECORDS))]
                    async for stored in store.follow(subjects.CONTROL, patterns, from_seq=seq):
                        seq = stored.seq + 1
                        if isinstance(stored.event, Finding):
                            findings.append((time.time(), stored.event))
                        elif stored.event is not None:
                            arrivals.append((time.time(), type(stored.event).__name__,
                                             getattr(stored.event, "attempt", -1)))
                except Exception as exc:
                    log.warning("following findings failed; again", error=repr(exc), from_seq=seq)
                    await asyncio.sleep(0.2)

        follower = asyncio.create_task(follow_findings())
        submitted = time.time()
        await plat.submit(store, job_id, c.num_ranks, policy)
        await hub.until(lambda: hub.started[0] >= len(nodes), 300, "attempt 0 to start on every node")
        first_start_s = time.time() - submitted
        await asyncio.sleep(c.settle_s)

        # Steady state: ingest and CPU.
        pids = {**{n: p.pid(n) for n in SERVICES}, "nats-server": p.broker.proc.pid,
                **{f"sim{w}": proc.pid or 0 for w, proc in enumerate(workers)}}
        cpu = Cpu(pids)
        pub0, ent0, t0 = hub.total("published"), hub.total("entries"), time.time()
        load0 = os.getloadavg()
        await asyncio.sleep(c.window_s)
        steady_cpu = cpu.percent()
        t1 = time.time()
        published = (hub.total("published") - pub0) / (t1 - t0)
        entries = (hub.total("entries") - ent0) / (t1 - t0)
        ticks = [t for t in await health_ticks(store, t0) if t.now <= t1]
        ingest = gap = float("nan")  # fewer than two ticks folded in the window: the monitor fell behind
        if len(ticks) >= 2:
            span = ticks[-1].now - ticks[0].now
            ingest = (ticks[-1].positions[subjects.TELEMETRY] - ticks[0].positions[subjects.TELEMETRY]) / span
            gap = span / (len(ticks) - 1)
        steady = {"window_s": round(t1 - t0, 1), "load_avg": [round(x, 2) for x in (load0, os.getloadavg())[1]],
                  "load_avg_before": [round(x, 2) for x in load0], "cpu_percent": steady_cpu,
                  "published_msgs_per_s": round(published), "rank_heartbeats_per_s": round(entries),
                  "health_folded_msgs_per_s": _round(ingest), "health_tick_interval_s": _round(gap, 3),
                  "health_rank_heartbeats_per_s": _round(ingest * entries / published if published else 0.0),
                  "dropped": hub.total("dropped"), "pending_acks": hub.total("pending"),
                  "ack_s_mean": round(hub.total("ack_s_sum") / max(hub.total("published"), 1), 4),
                  "ack_s_max": round(max((s.get("ack_s_max", 0.0) for s in hub.stats.values()), default=0.0), 3)}

        # Kills: one rank per attempt; the scheduler restarts the job on each RankLost. A restart nobody
        # killed for (a false finding, when telemetry falls behind) moves on to the newest running attempt.
        rng = random.Random(c.seed)
        samples: list[dict[str, Any]] = []
        kill_cpu = Cpu(pids)
        error = ""
        unanswered: list[int] = []
        try:
            for _ in range(c.kills):
                attempt = max(a for a, n in hub.started.items() if n >= len(nodes))
                rank = rng.randrange(c.num_ranks)
                for conn in hub.conns:
                    conn.send(("kill", rank))
                try:
                    await hub.until(lambda r=rank, a=attempt: any(k[0] == r and k[1] >= a for k in hub.killed), 20,
                                    f"rank {rank} to be killed")
                except TimeoutError:
                    unanswered.append(rank)  # its worker never had it running: try another
                    continue
                attempt = max(a for r, a in hub.killed if r == rank)

                def lost(r: int = rank, a: int = attempt) -> tuple[float, RankLost] | None:
                    return next(((t, f) for t, f in findings if isinstance(f, RankLost) and f.rank == r
                                 and f.attempt == a), None)

                await hub.until(lambda: lost() is not None, c.kill_timeout_s, f"RankLost of rank {rank}")
                seen_at, finding = lost() or (0.0, None)
                assert finding is not None
                last_beat, _ = hub.killed[(rank, attempt)]
                await hub.until(lambda a=attempt: hub.started[a + 1] >= len(nodes), 300, f"attempt {attempt + 1}")
                samples.append({"rank": rank, "attempt": attempt, "detect_s": round(seen_at - last_beat, 3),
                                "detect_from_last_seen_s": round(seen_at - finding.last_seen, 3),
                                "restart_s": round(time.time() - seen_at, 2), "load_1m": round(os.getloadavg()[0], 2)})
                samples[-1]["health_caught_up_s"] = round(await caught_up(store, time.time() + 300), 2)
                samples[-1]["records"] = breakdown(arrivals, seen_at, attempt)
                await asyncio.sleep(c.settle_s)
        except TimeoutError as exc:
            error = f"{exc} (killed: {sorted(hub.killed)[-3:]}, started: {dict(hub.started)})"
        kill_phase_cpu = kill_cpu.percent()
        follower.cancel()
        killed = {(s["rank"], s["attempt"]) for s in samples}
        false = [f"{type(f).__name__} rank {f.rank} attempt {f.attempt}" for _, f in findings
                 if not (isinstance(f, RankLost) and (f.rank, f.attempt) in killed)]
        detect = [s["detect_s"] for s in samples]
        return {
            "ranks": c.num_ranks, "mode": c.mode, "nodes": len(nodes), "sim_processes": procs_n,
            "threshold_s": c.threshold_s, "tick_s": c.tick_s, "step_s": c.step_s,
            "first_start_s": round(first_start_s, 2),
            "steady": steady,
            "detection": {"n": len(detect), "p50_s": percentile(detect, 50), "p99_s": percentile(detect, 99),
                          "max_s": max(detect, default=float("nan")),
                          "mean_restart_s": round(statistics.fmean(s["restart_s"] for s in samples), 2)
                          if samples else None,
                          "samples": samples},
            "kill_phase_cpu_percent": kill_phase_cpu,
            "other_findings": false, "restarts": max(hub.started), "error": error,
            "kills_unanswered": unanswered,
        }
    finally:
        if hub is not None:
            hub.detach()
            for conn in hub.conns:
                with contextlib.suppress(Exception):
                    conn.send(("quit",))
        for proc in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        with contextlib.suppress(Exception):
            await store.close()
        p.stop()
