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
import os
import re
import signal
import sys
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from events import subjects
from events.base import NodeEvent
from events.fleet import NodeRegistered, SelfCheckFailed, SelfCheckPassed
from events.store import EventStore
from events.streams import ServerTooOld
from services.broker import nats_url
from services.checkpoints.stores import open_store
from services.connection import Connection
from services.fold import rebuild
from services.logging import configure
from services.resources import agentcore
from services.resources.beats import BeatRelay, new_address, store_publisher
from services.resources.inventory import (
    DEFAULT_CPU_SLOTS,
    AgentError,
    Device,
    Inventory,
    Verdict,
    default_node,
    detect,
    selfcheck,
    trainer_accepts,
)
from services.resources.launch import REPO, Launch, Paths, die_with_agent, standby_env
from services.resources.spawner import Spawner, retrying
from services.resources.standbys import StandbyPool
from services.runtime import ConsumerPolicy, PublishDenied, run_service
from trainer.beats import STEP_REPORTS, STEP_REPORTS_ENV

log = structlog.get_logger("flightdeck.agent")

STANDBY_ENV = "FLIGHTDECK_STANDBY"  # the default for --standby (unset: one per slot)
HEARTBEATS_ENV = "FLIGHTDECK_HEARTBEATS"  # the default for --heartbeats
HEARTBEATS = ("node", "rank")
ORPHAN_EXIT = -signal.SIGKILL  # a rank that died with its agent (PR_SET_PDEATHSIG)


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
                    standby: int | None = None, heartbeats: str | None = None, step_reports: str | None = None,
                    stop_event: asyncio.Event | None = None) -> int:
    """Run the agent of `node` until `stop_event` is set; returns the process exit code (0: stopped cleanly).
    `standby`: warm standby ranks to keep (None: one per slot). `heartbeats`: "node" relays the ranks' beats
    in one batch per job per interval, "rank" leaves each rank to publish its own. `step_reports`: "all" or
    "rank0". None: from the environment (`$FLIGHTDECK_HEARTBEATS`, `$FLIGHTDECK_STEP_REPORTS`), else node, all."""
    heartbeats = heartbeats or env_choice(HEARTBEATS_ENV, HEARTBEATS, "node")
    step_reports = step_reports or env_choice(STEP_REPORTS_ENV, STEP_REPORTS, "all")
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
            beats = new_address(node) if heartbeats == "node" else ""  # the relay's socket, bound below
            launch = Launch(nats_url=url, device="cuda" if inv.kind == "gpu" else "cpu", grace_s=grace_s,
                            checkpoints_flag=await trainer_accepts(python, "--checkpoints"), beats=beats,
                            step_reports=step_reports)
            pool = StandbyPool(size=standbys, python=python, env=standby_env(), cwd=REPO,
                               log_file=Paths(root).standby_log, preexec=die_with_agent(os.getpid()), producer=producer)
            spawner = Spawner(node=node, producer=producer, store=store, objects=objs, paths=Paths(root), launch=launch,
                              standbys=pool if pool.size > 0 else None)
            if beats:
                relay = BeatRelay(node=node, producer=producer, publish=store_publisher(store),
                                  admit=spawner.speaks_for, address=beats)
                relay.start()
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


def add_heartbeat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeats", choices=HEARTBEATS, default=None,
                   help=f"node: relay the ranks' heartbeats in one batch per job per interval; rank: each rank "
                        f"publishes its own (default: ${HEARTBEATS_ENV}, else node)")
    p.add_argument("--step-reports", choices=STEP_REPORTS, default=None,
                   help=f"rank0: only rank 0 publishes a StepCompleted per step, the others' steps ride the "
                        f"heartbeat batches (fleets of thousands of ranks); default: ${STEP_REPORTS_ENV}, else all")


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
    add_heartbeat_arguments(p)
    args = p.parse_args(argv)
    if args.slots is not None and args.slots < 1:
        p.error("--slots must be at least 1")
    if args.standby is not None and args.standby < 0:
        p.error("--standby must be 0 or more")
    configure()

    async def go() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_agent(nats=args.nats, node=args.node, slots=args.slots, device=args.device,
                               data_dir=args.data_dir, objects=args.objects, address=args.address,
                               grace_s=args.grace_s, selfcheck_timeout_s=args.selfcheck_timeout_s,
                               standby=args.standby, heartbeats=args.heartbeats, step_reports=args.step_reports,
                               stop_event=stop)

    try:
        return asyncio.run(go())
    except (AgentError, subjects.InvalidSubjectToken) as exc:
        print(f"python -m services.resources.agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
