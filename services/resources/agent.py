"""The node agent: one per host. It finds the host's slots, runs the self-check, registers the node, then
runs its core (agentcore.py) in the service shell, starting and stopping trainer ranks (spawner.py).

    python -m services.resources.agent [--nats URL] [--node NAME] [--slots N] [--device auto|cpu|cuda]
                                       [--data-dir .flightdeck] [--objects URL] [--address 127.0.0.1]
                                       [--grace-s 30] [--selfcheck-timeout-s 300] [--standby N]
                                       [--heartbeats node|rank] [--step-reports all|rank0]

Slots: GPUs listed by nvidia-smi (the agent never imports torch), else `--slots` CPU slots (default 2).
Standbys (standbys.py): `--standby N` warm rank processes with torch imported, started with the self-check
(dropped if it fails) and refilled after each hand-off; default ($FLIGHTDECK_STANDBY, else one per slot, since
a restart starts all of a job's ranks on the node at once and waits for the slowest); 0 turns them off.
Heartbeats (beats.py): by default the ranks hand their heartbeats to the agent over a node-local socket and
the agent publishes one RankHeartbeats per job per interval; `--heartbeats rank` has each rank publish its
own. `--step-reports rank0` (for fleets of thousands of ranks) leaves only rank 0 publishing a StepCompleted
per step; the others' steps and step times ride the agent's batches. Defaults: $FLIGHTDECK_HEARTBEATS,
$FLIGHTDECK_STEP_REPORTS, else node and all.
SIGTERM/SIGINT: the ranks are stopped (they checkpoint on SIGTERM), their exits recorded, then the agent
exits 0. SIGKILL: the ranks die with it; the next agent on the node records them as exited.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import structlog

from events import subjects
from events.base import NodeEvent
from events.fleet import NodeRegistered, SelfCheckFailed, SelfCheckPassed
from events.heartbeats import RankHeartbeats
from events.store import EventStore
from events.streams import ServerTooOld
from services.broker import nats_url
from services.checkpoints.stores import open_store
from services.connection import TRANSIENT, Connection
from services.fold import rebuild
from services.logging import configure
from services.resources import agentcore
from services.resources.beats import BeatRelay, Publish
from services.resources.spawner import REPO, Launch, Paths, Spawner, die_with_agent, retrying, standby_env
from services.resources.standbys import StandbyPool
from services.runtime import ConsumerPolicy, PublishDenied, run_service
from trainer.beats import STEP_REPORTS, STEP_REPORTS_ENV

log = structlog.get_logger("flightdeck.agent")

DEFAULT_CPU_SLOTS = 2
STANDBY_ENV = "FLIGHTDECK_STANDBY"  # the default for --standby (unset: one per slot)
HEARTBEATS_ENV = "FLIGHTDECK_HEARTBEATS"  # the default for --heartbeats
HEARTBEATS = ("node", "rank")
ORPHAN_EXIT = -signal.SIGKILL  # a rank that died with its agent (PR_SET_PDEATHSIG)
Device = Literal["auto", "cpu", "cuda"]


class AgentError(RuntimeError):
    """A setup the agent cannot run with; the message says what to change."""


@dataclass(frozen=True)
class Inventory:
    kind: Literal["cpu", "gpu"]
    slots: int
    devices: list[str]
    memory_gb: float


def parse_gpus(text: str) -> list[tuple[str, float]]:
    """(name, memory in GB) per line of `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        name, _, mib = line.rpartition(",")
        try:
            gpus.append((name.strip(), round(float(mib) / 1024, 1)))
        except ValueError:
            gpus.append((line, 0.0))
    return gpus


def _nvidia_gpus() -> list[tuple[str, float]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_gpus(out.stdout) if out.returncode == 0 else []


def _host_memory_gb() -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def detect(device: Device, slots: int | None) -> Inventory:
    gpus = _nvidia_gpus() if device != "cpu" else []
    if device == "cuda" and not gpus:
        raise AgentError("--device cuda, but nvidia-smi lists no GPU: install the NVIDIA driver or use --device cpu")
    if gpus:
        n = len(gpus) if slots is None else slots
        if n > len(gpus):
            raise AgentError(f"--slots {slots}, but nvidia-smi lists only {len(gpus)} GPUs")
        return Inventory("gpu", n, [name for name, _ in gpus[:n]], gpus[0][1])
    n = slots or DEFAULT_CPU_SLOTS
    return Inventory("cpu", n, ["cpu"] * n, _host_memory_gb())


def default_node() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:128] or "node"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    seconds: float
    detail: str  # devices when it passed, the reason when it failed


async def selfcheck(python: str, inv: Inventory, timeout_s: float) -> Verdict:
    """`python -m trainer.selfcheck` (matmul with a known answer, all-reduce across the slots) in its own session."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        python, "-m", "trainer.selfcheck", "--slots", str(inv.slots),
        "--device", "cuda" if inv.kind == "gpu" else "cpu",
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError) as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the check's own worker processes too
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return Verdict(False, time.perf_counter() - started, f"self-check did not finish in {timeout_s:g}s")
    seconds = time.perf_counter() - started
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    if proc.returncode == 0 and result.get("ok") is True:
        # seconds: the whole check as the node waited for it (interpreter and torch start included)
        devices = ", ".join(result.get("devices", []))
        return Verdict(True, seconds, f"devices: {devices}; checks took {result.get('seconds', '?')}s")
    reason = str(result.get("reason") or err.decode(errors="replace").strip()[-2000:] or "no verdict printed")
    return Verdict(False, seconds, f"exit code {proc.returncode}: {reason}")


async def trainer_accepts(python: str, flag: str) -> bool:
    """Whether `python -m trainer` takes `flag` (read from its parser, without importing torch)."""
    proc = await asyncio.create_subprocess_exec(
        python, "-c", "from trainer.config import parser; print(parser().format_help())", cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    return proc.returncode == 0 and flag in out.decode().split()


def kill_if_rank(pid: int, job_id: str) -> None:
    """Kill `pid` if it is still a rank of `job_id` (it should have died with its agent; the pid may be reused)."""
    with contextlib.suppress(OSError):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cold = b"trainer" in cmdline and job_id.encode() in cmdline
        # A rank started by a standby keeps the standby's command line; its stdout is the rank's log.
        log_name = Path(os.readlink(f"/proc/{pid}/fd/1")).name if b"trainer.standby" in cmdline else ""
        warm = re.fullmatch(rf"{re.escape(job_id)}-a\d+-r\d+\.log", log_name) is not None
        if cold or warm:
            os.kill(pid, signal.SIGKILL)


async def reconcile(service: Any, store: EventStore, spawner: Spawner) -> int:
    """Record the ranks an earlier agent on this node started and never saw exit: they died with it."""
    folder = await rebuild(service, store, until=await store.last_seq(subjects.CONTROL))
    state: agentcore.State = folder.state
    for rank in state.live.values():
        kill_if_rank(rank.pid, rank.job_id)
        log.warning("rank lost with an earlier agent", job_id=rank.job_id, attempt=rank.attempt, rank=rank.rank,
                    pid=rank.pid)
        await spawner.record_exit(rank.job_id, rank.attempt, rank.rank, ORPHAN_EXIT, "")
    return len(state.live)


async def register(store: EventStore, node: str, producer: str, inv: Inventory, address: str, verdict: Verdict) -> None:
    """NodeRegistered, then the self-check's verdict (a failure makes the resource manager cordon the node)."""
    boot = uuid.uuid4().hex[:12]
    now = time.time()
    envelope: dict[str, Any] = {"node": node, "occurred_at": now, "producer": producer}
    events: list[NodeEvent] = [
        NodeRegistered(kind=inv.kind, slots=inv.slots, devices=inv.devices, memory_gb=inv.memory_gb, address=address,
                       event_id=f"{producer}:register:{boot}", **envelope)]
    if verdict.ok:
        events.append(SelfCheckPassed(seconds=round(verdict.seconds, 3), detail=verdict.detail,
                                      event_id=f"{producer}:selfcheck:{boot}", **envelope))
    else:
        events.append(SelfCheckFailed(reason=verdict.detail, event_id=f"{producer}:selfcheck:{boot}", **envelope))
    for ev in events:
        subject = subjects.node(node, type(ev).__name__)
        await retrying(f"appending {type(ev).__name__}", partial(store.append, subject, ev, msg_id=ev.event_id))


async def run_agent(*, nats: str | None = None, node: str | None = None, slots: int | None = None,
                    device: Device = "auto", data_dir: Path | str = ".flightdeck", objects: str | None = None,
                    address: str = "127.0.0.1", grace_s: float = 30.0, selfcheck_timeout_s: float = 300.0,
                    standby: int | None = None, heartbeats: str = "node", step_reports: str = "all",
                    stop_event: asyncio.Event | None = None) -> int:
    """Run the agent of `node` until `stop_event` is set; returns the process exit code (0: stopped cleanly).
    `standby`: warm standby ranks to keep (None: one per slot). `heartbeats`: "node" relays the ranks' beats
    in one batch per job per interval, "rank" leaves each rank to publish its own."""
    if heartbeats not in HEARTBEATS:
        raise AgentError(f"heartbeats {heartbeats!r}: choose one of {', '.join(HEARTBEATS)}")
    if step_reports not in STEP_REPORTS:
        raise AgentError(f"step reports {step_reports!r}: choose one of {', '.join(STEP_REPORTS)}")
    if step_reports == "rank0" and heartbeats != "node":
        raise AgentError("--step-reports rank0 needs --heartbeats node: "
                         "the agent's batches carry the other ranks' steps")
    stop = stop_event or asyncio.Event()
    url, node = nats_url(nats), subjects.token(node or default_node())
    producer = agentcore.service_name(node)
    structlog.contextvars.bind_contextvars(service=producer)
    root = Path.cwd() / data_dir  # absolute: ranks run with the repository as their working directory
    inv = await asyncio.to_thread(detect, device, slots)
    wanted = standby if standby is not None else standby_default()
    standbys = inv.slots if wanted is None else wanted
    python = sys.executable
    verdict_task = asyncio.create_task(selfcheck(python, inv, selfcheck_timeout_s))
    conn = Connection(producer)
    store = await conn.open(url, stop)
    if store is None:
        verdict_task.cancel()
        return 0
    code = 0
    pool: StandbyPool | None = None
    relay: BeatRelay | None = None
    try:
        async with open_store(objects or str(root / "objects")) as objs:
            launch = Launch(nats_url=url, device="cuda" if inv.kind == "gpu" else "cpu", grace_s=grace_s,
                            checkpoints_flag=await trainer_accepts(python, "--checkpoints"))
            pool = StandbyPool(size=standbys, python=python, env=standby_env(), cwd=REPO,
                               log_file=Paths(root).standby_log, preexec=die_with_agent(os.getpid()), producer=producer)
            spawner = Spawner(node=node, producer=producer, store=store, objects=objs, paths=Paths(root), launch=launch,
                              standbys=pool if pool.size > 0 else None)
            if heartbeats == "node":
                relay = BeatRelay(node=node, producer=producer, publish=beat_publisher(store), admit=spawner.speaks_for)
                relay.start()
                spawner.launch = dataclasses.replace(launch, beats=relay.address, step_reports=step_reports)
            # Warming while the self-check runs: on a host with cores to spare the first ranks find them ready.
            pool.start()
            service = agentcore.core_service(node, spawner.handlers())
            lost = await reconcile(service, store, spawner)
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({verdict_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not verdict_task.done():
                return 0  # stopped during the self-check (the finally below ends it)
            verdict = verdict_task.result()
            await register(store, node, producer, inv, address, verdict)
            log.info("node registered", kind=inv.kind, slots=inv.slots, selfcheck_ok=verdict.ok,
                     selfcheck_s=round(verdict.seconds, 2), detail=verdict.detail, orphans_recorded=lost,
                     trainer_checkpoints_flag=launch.checkpoints_flag, standbys=pool.size)
            if not verdict.ok:  # cordoned: it gets no ranks
                await pool.close()
                spawner.standbys = None
            shell_stop = asyncio.Event()
            shell = asyncio.create_task(run_service(service, url, stop_event=shell_stop,
                                                    policy=ConsumerPolicy.from_env()))
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({shell, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            shell_stop.set()  # no new ranks from here on
            try:
                await shell
            except (PublishDenied, ServerTooOld) as exc:
                log.error("agent stopped", error=str(exc))
                code = 3
            finally:
                await spawner.shutdown(wait_s=grace_s + 15.0)
    finally:
        if not verdict_task.done():
            verdict_task.cancel()
        if pool is not None:
            await pool.close()
        if relay is not None:
            await relay.close()
        conn.closing = True
        with contextlib.suppress(Exception):
            await store.nc.close()
    log.info("agent stopped", exit_code=code)
    return code


def beat_publisher(store: EventStore) -> Publish:
    """Publish a batch, or drop it when the broker does not take it within its interval (the next is newer)."""
    dropped = 0
    logged_at = 0.0

    async def publish(batch: RankHeartbeats) -> None:
        nonlocal dropped, logged_at
        subject = subjects.telemetry(batch.job_id, batch.rank, "RankHeartbeats")
        try:
            await asyncio.wait_for(store.append(subject, batch, msg_id=batch.event_id), batch.interval_s)
        except TRANSIENT as exc:
            dropped += 1
            if time.monotonic() - logged_at >= 10.0:
                logged_at = time.monotonic()
                log.warning("heartbeat batch dropped: the broker did not take it in time", job_id=batch.job_id,
                            attempt=batch.attempt, beats=len(batch.beats), dropped=dropped, error=repr(exc))
    return publish


def standby_default() -> int | None:
    """$FLIGHTDECK_STANDBY as a count (unset or empty: None, one per slot)."""
    raw = os.environ.get(STANDBY_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise AgentError(f"${STANDBY_ENV}={raw!r} is not a count of standby ranks: set it to 0 or more")
    return int(raw)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name, "").strip() or default
    if raw not in choices:
        raise AgentError(f"${name}={raw!r}: choose one of {', '.join(choices)}")
    return raw


def add_standby_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--standby", type=int, default=None, metavar="N",
                   help=f"warm standby ranks (torch imported) for fast restarts; 0: none "
                        f"(default: ${STANDBY_ENV}, else one per slot)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.resources.agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", help="broker URL (default: $FLIGHTDECK_NATS_URL or nats://127.0.0.1:4222)")
    p.add_argument("--node", help="this node's name (default: the host name)")
    p.add_argument("--slots", type=int, help=f"slots to offer (default: every GPU, else {DEFAULT_CPU_SLOTS} CPU slots)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--data-dir", default=".flightdeck", help="specs, checkpoint cache, staging and rank logs")
    p.add_argument("--objects", help="object store holding committed checkpoints (default: <data-dir>/objects)")
    p.add_argument("--address", default="127.0.0.1", help="where other nodes reach this one's rank 0")
    p.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM to SIGKILL when ranks are stopped")
    p.add_argument("--selfcheck-timeout-s", type=float, default=300.0, help="a self-check still running then fails")
    add_standby_argument(p)
    p.add_argument("--heartbeats", choices=HEARTBEATS, default=None,
                   help=f"node: relay the ranks' heartbeats in one batch per job per interval; rank: each rank "
                        f"publishes its own (default: ${HEARTBEATS_ENV}, else node)")
    p.add_argument("--step-reports", choices=STEP_REPORTS, default=None,
                   help=f"rank0: only rank 0 publishes a StepCompleted per step, the others' steps ride the "
                        f"heartbeat batches (fleets of thousands of ranks); default: ${STEP_REPORTS_ENV}, else all")
    args = p.parse_args(argv)
    if args.slots is not None and args.slots < 1:
        p.error("--slots must be at least 1")
    if args.standby is not None and args.standby < 0:
        p.error("--standby must be 0 or more")
    configure()
    try:
        heartbeats = args.heartbeats or env_choice(HEARTBEATS_ENV, HEARTBEATS, "node")
        step_reports = args.step_reports or env_choice(STEP_REPORTS_ENV, STEP_REPORTS, "all")
    except AgentError as exc:
        print(f"python -m services.resources.agent: {exc}", file=sys.stderr)
        return 2

    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_agent(nats=args.nats, node=args.node, slots=args.slots, device=args.device,
                               data_dir=args.data_dir, objects=args.objects, address=args.address,
                               grace_s=args.grace_s, selfcheck_timeout_s=args.selfcheck_timeout_s,
                               standby=args.standby, heartbeats=heartbeats, step_reports=step_reports,
                               stop_event=stop)

    try:
        return asyncio.run(go())
    except (AgentError, subjects.InvalidSubjectToken) as exc:
        print(f"python -m services.resources.agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
