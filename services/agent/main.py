"""The node agent: one per host. It finds the host's slots, runs the self-check, registers the node, then
runs its core (agentcore.py) in the service shell, starting and stopping trainer ranks (spawner.py).

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import structlog

from flightdeck.events import subjects
from flightdeck.events.base import NodeEvent
from flightdeck.events.fleet import NodeRegistered, SelfCheckFailed, SelfCheckPassed
from flightdeck.events.job import RankExit
from flightdeck.events.nodelocal import STEP_REPORTS, STEP_REPORTS_ENV
from flightdeck.events.store import EventStore
from flightdeck.events.streams import BrokerRefused
from flightdeck.services.agent import core as agentcore
from flightdeck.services.agent import shmroots, snapshots
from flightdeck.services.agent.alive import Alive, beat_interval
from flightdeck.services.agent.beats import BeatRelay, new_address, store_publisher
from flightdeck.services.agent.closing import close_within
from flightdeck.services.agent.forkserver import ForkServer
from flightdeck.services.agent.inventory import (
    AgentError,
    Device,
    Inventory,
    Verdict,
    default_node,
    detect,
    selfcheck,
)
from flightdeck.services.agent.launch import Launch, Paths, die_with_agent, standby_env
from flightdeck.services.agent.links import RankLinks
from flightdeck.services.agent.nodeview import NodeView
from flightdeck.services.agent.spawner import Spawner, retrying
from flightdeck.services.agent.standbys import StandbyPool
from flightdeck.services.core import Emit
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.shell.connection import Connection
from flightdeck.services.shell.fold import rebuild
from flightdeck.services.shell.objects.open import open_store
from flightdeck.services.shell.runtime import ConsumerPolicy, PublishDenied, run_service

log = structlog.get_logger("flightdeck.agent")

STANDBY_ENV = "FLIGHTDECK_STANDBY"  # the default for --standby (unset: one per slot and one more)
PRELOAD_ENV = "FLIGHTDECK_PRELOAD"  # the default for --preload
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
HEARTBEATS_ENV = "FLIGHTDECK_HEARTBEATS"  # the default for --heartbeats
HEARTBEATS = ("node", "rank")
ORPHAN_EXIT = -signal.SIGKILL  # a rank that died with its agent (PR_SET_PDEATHSIG)


def started_at(pid: int) -> float:
    """When process `pid` started, in wall-clock seconds (to a second: the kernel's boot time is whole seconds)."""
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def kill_if_rank(pid: int, job_id: str, recorded_at: float = 0.0) -> bool:
    """Kill `pid` if it is still a rank of `job_id` (it should have died with its agent; the pid may be reused);
    whether it did. `recorded_at`: when its start was recorded (WorkersStarted), which a process reusing the pid
    started after."""
    with contextlib.suppress(OSError):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cold = b"trainer" in cmdline and job_id.encode() in cmdline
        # A rank started by a standby keeps the standby's command line (or the fork server's, which forked it). Its
        # stdout is a pipe to the agent that started it, so its start time tells it from a process that took its pid
        # since (a standby handed a log file is known by that file's name).
        standby = b"flightdeck.trainer.standby" in cmdline or b"flightdeck.trainer.forkserver" in cmdline
        log_name = Path(os.readlink(f"/proc/{pid}/fd/1")).name if standby else ""
        warm = standby and (re.fullmatch(rf"{re.escape(job_id)}-a\d+-r\d+\.log", log_name) is not None
                            or (recorded_at > 0 and started_at(pid) <= recorded_at + CLOCK_SLACK_S))
        if cold or warm:
            os.kill(pid, signal.SIGKILL)
            return True
    return False


async def gone(pids: list[int], within_s: float = 5.0) -> None:
    """Until each of `pids` has stopped running (exited, or a zombie), for at most `within_s`."""
    deadline = time.monotonic() + within_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _running(p)]
        if pids:
            await asyncio.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


CLOCK_SLACK_S = 1.0  # a process's start time is known to the second


async def reconcile(service: Any, store: EventStore, spawner: Spawner) -> int:
    """Record the ranks an earlier agent on this node started and never saw exit: they died with it, or are killed
    now (a rank that outlived its agent kept training, and writing the snapshots its next attempt restores)."""
    folder = await rebuild(service, store, until=await store.last_seq(subjects.CONTROL))
    state: agentcore.State = folder.state
    lost: dict[tuple[str, int], list[RankExit]] = {}
    killed = []
    for rank in state.live.values():
        if kill_if_rank(rank.pid, rank.job_id, rank.recorded_at):
            killed.append(rank.pid)
        log.warning("rank lost with an earlier agent", job_id=rank.job_id, attempt=rank.attempt, rank=rank.rank,
                    pid=rank.pid, killed_now=rank.pid in killed)
        lost.setdefault((rank.job_id, rank.attempt), []).append(RankExit(rank=rank.rank, exit_code=ORPHAN_EXIT,
                                                                                   orphaned=True))
    # A rank that outlived its agent may still be writing a snapshot: its slots are read only once it has stopped.
    await gone(killed)
    persisted = await persist_orphans(store, spawner, lost)
    for (job_id, attempt), exits in lost.items():  # one record per attempt, as for ranks this agent stops
        await spawner.exits.record(job_id, attempt, exits, "")
    for job_id, attempt in persisted:  # uploaded after the exits are on record, as for ranks this agent ran
        task = asyncio.create_task(spawner.shipper.finish(job_id, attempt))
        spawner.timers.add(task)
        task.add_done_callback(spawner.timers.discard)
    return len(state.live)


async def persist_orphans(store: EventStore, spawner: Spawner,
                          lost: dict[tuple[str, int], list[RankExit]]) -> list[tuple[str, int]]:
    """Finish what the earlier agent would have done for ranks that died with it: stage each one's good snapshots
    (it may have been killed while it did), under ids of this agent's own, for this agent's shipper."""
    root = spawner.paths.snapshots
    if root is None:
        return []
    again = uuid.uuid4().hex[:12]
    for (job_id, attempt), exits in lost.items():
        ranks = [e.rank for e in exits]
        spawner.shipper.watch(job_id, attempt, ranks, await spawner.shipper.start_seq())
        for i, rank in enumerate(ranks):
            staged, own = await snapshots.recorded(store, job_id, attempt, rank, ranks)
            persisted, newest = await snapshots.persist(root, store, job_id, attempt, rank, staged, own,
                                                        node=spawner.node, producer=spawner.producer, again=again)
            exits[i] = msgspec.structs.replace(exits[i], persisted=persisted, persisted_at=newest)  # its exit says so
    return list(lost)


def registration(node: str, inv: Inventory, address: str, verdict: Verdict, snapshot_bytes: int) -> list[NodeEvent]:
    """NodeRegistered and the self-check's verdict, their envelopes left to whoever appends them."""
    events: list[NodeEvent] = [
        NodeRegistered(node=node, kind=inv.kind, slots=inv.slots, devices=inv.devices, memory_gb=inv.memory_gb,
                       address=address, snapshot_bytes=snapshot_bytes)]
    if verdict.ok:
        events.append(SelfCheckPassed(node=node, seconds=round(verdict.seconds, 3), detail=verdict.detail))
    else:
        events.append(SelfCheckFailed(node=node, reason=verdict.detail))
    return events


async def register(store: EventStore, node: str, producer: str, inv: Inventory, address: str, verdict: Verdict, *,
                   snapshot_bytes: int = -1) -> None:
    """NodeRegistered, then the self-check's verdict (a failure makes the resource manager cordon the node)."""
    boot = uuid.uuid4().hex[:12]
    now = time.time()
    for ev, what in zip(registration(node, inv, address, verdict, snapshot_bytes), ("register", "selfcheck"),
                        strict=True):
        ev = msgspec.structs.replace(ev, occurred_at=now, producer=producer, event_id=f"{producer}:{what}:{boot}")
        subject = subjects.node(node, type(ev).__name__)
        await retrying(f"appending {type(ev).__name__}", partial(store.append, subject, ev, msg_id=ev.event_id))


async def rejoin(node: str, inv: Inventory, address: str, snapshot_bytes: int,
                 check: Callable[[], Awaitable[Verdict]], reason: str) -> list[Emit]:
    """Join again after this node was declared lost while the agent ran: the self-check first, as at a start; its
    registration and verdict go out as the rejoin effect's outputs (a passed one lifts the loss cordon)."""
    log.warning("this node was declared lost while its agent ran: its ranks are fenced; joining again", reason=reason)
    verdict = await check()
    events = registration(node, inv, address, verdict, snapshot_bytes)
    log.info("node registered again", selfcheck_ok=verdict.ok, detail=verdict.detail)
    return [Emit(subjects.node(node, type(ev).__name__), ev) for ev in events]


@dataclass(frozen=True)
class AgentOptions:
    """What one agent runs with; bootstrap.py fills it from the command line and the environment."""

    nats: str | None = None
    node: str | None = None  # default: the host name
    slots: int | None = None  # default: every GPU, else DEFAULT_CPU_SLOTS CPU slots
    device: Device = "auto"
    data_dir: Path | str = ".flightdeck"
    objects: str | None = None  # default: <data_dir>/objects
    address: str = "127.0.0.1"  # where other nodes reach this node's rank 0
    grace_s: float = 30.0  # SIGTERM to SIGKILL when ranks are stopped
    selfcheck_timeout_s: float = 300.0
    standby: int | None = None  # warm standby ranks (None: $FLIGHTDECK_STANDBY, else one per slot and one more)
    heartbeats: str | None = None  # "node" relays beats in one batch per job per interval; "rank": each its own
    step_reports: str | None = None  # "all" or "rank0"; None for both: the environment, else node and all
    preload: str | None = None  # modules the fork server imports for the jobs' code; None: $FLIGHTDECK_PRELOAD
    # The ranks' host snapshots (services/agent/snapshots.py): a folder, "off", or None for shared memory
    snapshots: str | None = None
    snapshot_memory: int | None = None  # a cap on what they may take, below the folder's free space


async def run_agent(options: AgentOptions, stop_event: asyncio.Event | None = None) -> int:
    """Run the agent until `stop_event` is set; returns the process exit code (0: stopped cleanly)."""
    o = options
    nats, node, slots, device, data_dir, objects = o.nats, o.node, o.slots, o.device, o.data_dir, o.objects
    address, grace_s, selfcheck_timeout_s, standby = o.address, o.grace_s, o.selfcheck_timeout_s, o.standby
    heartbeats, step_reports = o.heartbeats, o.step_reports
    preload = preload_modules(o.preload if o.preload is not None else os.environ.get(PRELOAD_ENV, ""))
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
    idle_beat_s = beat_interval()
    # One more than the slots: a restart replaced at once (a lost node's first restart is granted before the node
    # is known lost) leaves a warm one for the next while the replacements still import torch.
    standbys = inv.slots + 1 if wanted is None else wanted
    python = sys.executable
    # The standbys and the self-check are forked from one warm process: torch is imported once on this node. On GPU
    # nodes too: the server's imports never initialise the CUDA driver (tests/gpu), so its children still get CUDA.
    forks = ForkServer(python=python, env=standby_env(), cwd=Path.cwd(), log_file=Paths(root).standby_log,
                       preexec=die_with_agent(os.getpid()), preload=preload) if standbys > 0 else None
    verdict_task = asyncio.create_task(selfcheck(python, inv, selfcheck_timeout_s, forks))
    conn = Connection(producer)
    store = await conn.open(url, stop)
    if store is None:
        verdict_task.cancel()
        if forks is not None:
            await forks.close()
        return 0
    code = 0
    pool: StandbyPool | None = None
    view: NodeView | None = None
    relay: BeatRelay | None = None
    links: RankLinks | None = None
    alive: Alive | None = None
    try:
        async with open_store(objects or str(root / "objects")) as objs:
            beats = new_address(node) if heartbeats == "node" else ""  # the relay's socket, bound below
            launch = Launch(device="cuda" if inv.kind == "gpu" else "cpu", grace_s=grace_s,
                            beats=beats,
                            step_reports=step_reports)
            pool = StandbyPool(size=standbys, python=python, env=standby_env(), cwd=Path.cwd(),
                               log_file=Paths(root).standby_log, preexec=die_with_agent(os.getpid()), producer=producer,
                               forks=forks)
            paths = Paths(root, snapshots=snapshot_root(o.snapshots, root, node))
            if paths.snapshots is not None:  # shared memory is RAM: what dead agents of gone platforms left is freed
                await asyncio.to_thread(shmroots.claim, paths.snapshots, root)
                await asyncio.to_thread(shmroots.reclaim, paths.snapshots)
            spawner = Spawner(node=node, producer=producer, store=store, objects=objs, paths=paths, launch=launch,
                              standbys=pool if pool.size > 0 else None)
            links = RankLinks(node=node, store=store, admit=spawner.claims)
            links.start()
            spawner.links = links
            if beats:
                relay = BeatRelay(node=node, producer=producer, publish=store_publisher(store),
                                  admit=spawner.speaks_for, address=beats)
                relay.start()
                spawner.relay = relay
            # Warming while the self-check runs: on a host with cores to spare the first ranks find them ready.
            pool.start()
            spawner.recheck = partial(selfcheck, python, inv, selfcheck_timeout_s, forks)
            service = agentcore.core_service(node, spawner.handlers())
            lost = await reconcile(service, store, spawner)
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({verdict_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not verdict_task.done():
                return 0  # stopped during the self-check (the finally below ends it)
            verdict = verdict_task.result()
            room = await asyncio.to_thread(snapshots.capacity, paths.snapshots, o.snapshot_memory)
            await register(store, node, producer, inv, address, verdict, snapshot_bytes=room)
            spawner.rejoin = partial(rejoin, node, inv, address, room, spawner.recheck)
            log.info("node registered", kind=inv.kind, slots=inv.slots, selfcheck_ok=verdict.ok,
                     selfcheck_s=round(verdict.seconds, 2), detail=verdict.detail, orphans_recorded=lost,
                     standbys=pool.size)
            alive = Alive(store, node, producer, busy=lambda: len(spawner.pids), interval_s=idle_beat_s)
            alive.start()  # cordoned or not: its silence would tell the node is gone
            if not verdict.ok:  # cordoned: it gets no ranks
                await pool.close()
                spawner.standbys = None
                if forks is not None:
                    await forks.close()
            else:  # the fleet sees its free slots and warm standbys (the dashboard's fleet view)
                view = NodeView(store, node, producer, inv.slots, busy=lambda: len(spawner.pids),
                                standbys=lambda: pool.ready if pool is not None else 0, snapshots=paths.snapshots)
                pool.on_change = view.changed
                view.start()
            shell_stop = asyncio.Event()
            shell = asyncio.create_task(run_service(service, url, stop_event=shell_stop,
                                                    policy=ConsumerPolicy.from_env()))
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({shell, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            shell_stop.set()  # no new ranks from here on
            try:
                await shell
            except (PublishDenied, BrokerRefused) as exc:
                log.error("agent stopped", error=str(exc))
                code = 3
            finally:
                await spawner.shutdown(wait_s=grace_s + 15.0)
    finally:
        if not verdict_task.done():
            verdict_task.cancel()
        if pool is not None:
            pool.on_change = lambda: None  # closing: nothing more to tell
            await close_within("standby pool", pool.close())
        if forks is not None:  # last: the ranks it forked are stopped (spawner.shutdown) or die with it
            await close_within("fork server", forks.close())
        if view is not None:
            await close_within("node view", view.close())
        if alive is not None:
            await close_within("sign of life", alive.close())
        if relay is not None:
            await close_within("heartbeat relay", relay.close())
        if links is not None:  # what the ranks handed over reaches the broker before the agent goes
            await close_within("rank links", links.close())
        conn.closing = True
        with contextlib.suppress(Exception):
            await close_within("broker connection", store.nc.close())
    log.info("agent stopped", exit_code=code)
    return code


def snapshot_root(choice: str | None, root: Path, node: str) -> Path | None:
    if choice == "off":
        return None
    return Path(choice).resolve() if choice else snapshots.default_root(root, node)


def preload_modules(raw: str) -> tuple[str, ...]:
    """--preload's comma-separated module names, each checked: a typo is an error at start, not a cold node."""
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    for name in names:
        if not MODULE_NAME.fullmatch(name):
            raise AgentError(f"--preload {name!r} is not a module name: give dotted names separated by commas, "
                             f"e.g. transformers.models.gpt2.modeling_gpt2")
    return names


def standby_default() -> int | None:
    """$FLIGHTDECK_STANDBY as a count (unset or empty: None, one per slot and one more)."""
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
