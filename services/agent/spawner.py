"""The node agent's effects: start a job's ranks, stop them, keep the node's checkpoint cache (cache.py), and
watch every rank until it exits (recorded as WorkersExited, one record per node and attempt: exits.py).

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from flightdeck.events import nodelocal as nl
from flightdeck.events import ranklink
from flightdeck.events.heartbeats import LocalBeat
from flightdeck.events.history import append_to_job
from flightdeck.events.job import Persisted, RankExit, SlotRef, WorkersStarted
from flightdeck.events.spec import spec_toml
from flightdeck.events.store import EventStore
from flightdeck.services.agent import snapshots
from flightdeck.services.agent.beats import BeatRelay
from flightdeck.services.agent.cache import CheckpointCache
from flightdeck.services.agent.closing import close_within
from flightdeck.services.agent.codecache import CodeCache
from flightdeck.services.agent.core import (
    EVICT,
    PREFETCH,
    REJOIN,
    SELFCHECK,
    SPAWN,
    STOP,
    TELL,
    EvictArgs,
    PrefetchArgs,
    RejoinArgs,
    SelfCheckArgs,
    SpawnArgs,
    StopArgs,
    TellArgs,
)
from flightdeck.services.agent.envs import EnvCache, EnvError
from flightdeck.services.agent.exits import ExitRecorder
from flightdeck.services.agent.inventory import Verdict, recheck
from flightdeck.services.agent.launch import (
    Launch,
    Paths,
    detached,
    die_with_agent,
    fired_faults,
    rank_command,
    rank_env_of,
)
from flightdeck.services.agent.links import NOT_TOLD, RankLinks
from flightdeck.services.agent.output import OutputPump, store_publisher
from flightdeck.services.agent.rankproc import RankProc, error_of, last_lines, retrying, runnable_problem, signal_rank
from flightdeck.services.agent.shipping import Shipper
from flightdeck.services.agent.standbys import StandbyPool
from flightdeck.services.core import EffectHandler, Emit
from flightdeck.services.shell.objects import manifest
from flightdeck.services.shell.objects.code import CodeError
from flightdeck.services.shell.objects.store import ObjectStore, ObjectStoreError

log = structlog.get_logger("flightdeck.agent")

OUTPUT_DRAIN_S = 3.0  # after a rank exits, for what it printed last (a child it left may hold the pipe longer)
START_FAILED_EXIT = 125  # recorded for ranks that could not be started (no checkpoint, no executable)
REFILL_HOLD_S = 30.0  # standbys are refilled once the ranks handed out are stepping, or this long after


class Spawner:
    def __init__(self, *, node: str, producer: str, store: EventStore, objects: ObjectStore, paths: Paths,
                 launch: Launch, standbys: StandbyPool | None = None) -> None:
        self.node, self.producer, self.store, self.objects = node, producer, store, objects
        self.paths, self.launch, self.standbys = paths, launch, standbys
        self.procs: dict[tuple[str, int, int], RankProc] = {}
        self.pids: dict[int, tuple[str, int, int]] = {}  # a live rank's pid -> (job, attempt, rank), from its start
        self.cache = CheckpointCache(node_paths=paths, objects=objects, producer=producer)
        self.codes = CodeCache(root=paths.root, objects=objects)
        self.envs = EnvCache(root=paths.root)
        self.shipper = Shipper(node=node, producer=producer, store=store, objects=objects, staging=paths.staging,
                               snapshots=paths.snapshots)
        self.relay: BeatRelay | None = None  # the heartbeat relay (node heartbeats): it beats for live attempts
        self.links: RankLinks | None = None  # the ranks' links: set by the agent before any rank starts
        self._pid_known: dict[int, asyncio.Future[None]] = {}  # a link that came before its rank's start was recorded
        self.timers: set[asyncio.Task[None]] = set()
        self.exits = ExitRecorder(store, node, producer, self.watched, retrying)
        self.going: dict[int, asyncio.Future[None]] = {}  # a rank from a standby -> set once its beats show a step
        self.beat_steps: dict[tuple[str, int, int], int] = {}  # a rank's newest step its heartbeats carried
        self.beat_stepped: set[tuple[str, int, int]] = set()  # ranks whose beats timed a step: one completed
        # The node's self-check (inventory.selfcheck with the agent's interpreter, slots and fork server), run again
        # when a spike's diagnosis suspects this node; set by the agent once it knows them.
        self.recheck: Callable[[], Awaitable[Verdict]] | None = None
        # Its registration again after the node was declared lost while the agent ran (main.rejoin): set once
        # the agent has registered.
        self.rejoin: Callable[[str], Awaitable[list[Emit]]] | None = None

    def watched(self, job_id: str, attempt: int) -> set[int]:
        """The attempt's ranks here whose exits are not recorded yet."""
        return {rank for (j, a, rank) in self.procs if (j, a) == (job_id, attempt)}

    def handlers(self) -> dict[str, EffectHandler]:
        async def spawn(args: Any) -> list[Emit]:
            assert isinstance(args, SpawnArgs), type(args)
            return await self.spawn(args)

        async def stop(args: Any) -> list[Emit]:
            assert isinstance(args, StopArgs), type(args)
            self.stop(args.job_id, args.attempt, args.reason, immediate=args.immediate)
            return []

        async def prefetch(args: Any) -> list[Emit]:
            assert isinstance(args, PrefetchArgs), type(args)
            if args.rollback:
                self.cache.fetch_for_rollback(args.job_id, args.checkpoint,
                                              partial(self._rollback_ready, args.job_id, args.checkpoint.checkpoint_id))
            else:
                self.cache.fetch_task(args.job_id, args.checkpoint)
            return []

        async def evict(args: Any) -> list[Emit]:
            assert isinstance(args, EvictArgs), type(args)
            await self.cache.evict(args.job_id, args.checkpoint_ids)
            if not args.checkpoint_ids and self.links is not None:  # the whole job's: it ended
                self.links.forget(args.job_id)
            if not args.checkpoint_ids and self.paths.snapshots is not None:
                await asyncio.to_thread(snapshots.forget_job, self.paths.snapshots, args.job_id)
            return []

        async def tell(args: Any) -> list[Emit]:
            assert isinstance(args, TellArgs), type(args)
            if self.links is not None and args.command:
                self.links.command(args.job_id, args.attempt, args.command)
            if self.links is not None and args.plan is not None:
                self.links.plan(args.job_id, args.plan)
            return []

        async def selfcheck(args: Any) -> list[Emit]:
            assert isinstance(args, SelfCheckArgs), type(args)
            return await recheck(self.node, self.recheck, args)

        async def rejoin(args: Any) -> list[Emit]:
            assert isinstance(args, RejoinArgs), type(args)
            return await self.fence_and_rejoin(args.reason)

        return {SPAWN: spawn, STOP: stop, PREFETCH: prefetch, EVICT: evict, SELFCHECK: selfcheck, TELL: tell,
                REJOIN: rejoin}

    async def fence_and_rejoin(self, reason: str) -> list[Emit]:
        """The node was declared lost while this agent ran: every rank here belongs to an attempt the scheduler
        has replaced (their exits are recorded as they die), so each is killed now, before the node joins again."""
        for job_id, attempt in sorted({(p.job_id, p.attempt) for p in self.procs.values() if p.alive}):
            self.stop(job_id, attempt, f"this node was declared lost: {reason}", immediate=True)
        if self.rejoin is None:  # declared lost before it registered: its registration is still to come
            return []
        return await self.rejoin(reason)

    # -- spawning ----------------------------------------------------------------------------------

    async def spawn(self, args: SpawnArgs) -> list[Emit]:
        bound = log.bind(job_id=args.job_id, attempt=args.attempt, ranks=[r.rank for r in args.ranks])
        if all((args.job_id, args.attempt, r.rank) in self.procs for r in args.ranks):
            return []  # this process started them already
        await self._clear_slots(args)
        if args.plan is not None and self.links is not None:
            self.links.plan(args.job_id, args.plan)  # known here before the ranks ask (an agent restarted since)
        if (init := args.spec.init_from) is not None and not init.checkpoint_id and args.restore is None:
            return await self._not_started(args, f"init_from names job {init.job} but no checkpoint of it: submit the "
                                           "spec with `flightdeck submit`, which chooses one", unrunnable=True)
        try:
            code_dir = await self.codes.folder(args.spec, {p.code for p in self.procs.values() if p.alive})
            python = await self.envs.python(args.spec.entrypoint, code_dir, self.launch.python) \
                if args.spec.entrypoint else None
        except CodeError as exc:  # missing, damaged or unsafe: a restart would fetch the same
            return await self._not_started(args, f"cannot run the job's code: {exc}", unrunnable=True)
        except EnvError as exc:  # the same again in the next attempt fails the job (policy.fail_fast)
            return await self._not_started(args, str(exc), error=exc.error)
        except ObjectStoreError as exc:
            return await self._not_started(args, f"fetching the job's code failed: {exc!r}")
        if python is not None and self.standbys is not None:  # its own interpreter: warm from a server of its own
            self.standbys.environment(python)
        cmd, cwd = rank_command(args, self.launch, code_dir, python)
        entry_env = args.spec.entrypoint.env if args.spec.entrypoint is not None else {}
        if (problem := runnable_problem(cmd, cwd, entry_env.get("PATH") or os.environ.get("PATH", ""))) is not None:
            return await self._not_started(args, problem, unrunnable=True)
        restore: Path | None = None
        from_memory = await snapshots.restores_in_memory(self.paths.snapshots, self.objects, args) \
            if self.paths.snapshots is not None else {}
        if args.restore is not None and len(from_memory) < len(args.ranks):
            try:
                restore = await self.cache.verified_copy(args.job_id, args.restore)
            except (manifest.CorruptCheckpoint, manifest.CheckpointMissing) as exc:
                await self.exits.rejected(args.job_id, args.attempt, args.restore, str(exc), args.grant_id)
                return await self._not_started(args, f"restore {args.restore.checkpoint_id} failed: {exc!r}")
            except Exception as exc:  # a checkpoint we cannot verify is never loaded, nor silently skipped
                return await self._not_started(args, f"restore {args.restore.checkpoint_id} failed: {exc!r}")
        fired = await retrying("reading which drill faults fired", lambda: fired_faults(self.store, args))
        ship_from = await retrying("reading where the telemetry stream ends", self.shipper.start_seq)
        started: list[RankProc] = []
        try:
            spec_file = await asyncio.to_thread(self._write_spec, args)
            for ref in args.ranks:
                started.append(await self._start_rank(args, ref, spec_file, from_memory.get(ref.rank, restore), fired,
                                                      (cmd, cwd)))
        except Exception as exc:  # recorded as exits, so the scheduler sees a fault instead of waiting forever
            for p in started:
                signal_rank(p, signal.SIGKILL)
                await p.proc.wait()
                self.pids.pop(p.proc.pid, None)
                self._got_going(p.proc.pid)
            return await self._not_started(args, f"could not start a rank: {exc!r}")
        event = WorkersStarted(job_id=args.job_id, node=self.node, attempt=args.attempt,
                               ranks=[p.ref.rank for p in started], pids=[p.proc.pid for p in started],
                               event_id=f"{self.producer}:start:{args.job_id}:{args.attempt}",
                               occurred_at=time.time(), causation_id=args.grant_id, producer=self.producer)
        await retrying("recording WorkersStarted", lambda: append_to_job(self.store, event, msg_id=event.event_id))
        self.shipper.watch(args.job_id, args.attempt, [p.ref.rank for p in started], ship_from)
        if self.relay is not None:
            self.relay.hold(args.job_id, args.attempt, args.spec.policy.heartbeat_interval_s,
                            min(p.ref.rank for p in started))
        for p in started:
            self.procs[(p.job_id, p.attempt, p.ref.rank)] = p
            p.watcher = asyncio.create_task(self._watch(p))
        going = [self.going[p.proc.pid] for p in started if p.proc.pid in self.going]
        if going and self.standbys is not None:
            self.standbys.refill_after(asyncio.gather(*going), REFILL_HOLD_S)
        bound.info("ranks started", pids=event.pids, restore=str(restore or ""), master_port=args.master_port,
                   from_memory=sorted(from_memory))
        return []

    async def _clear_slots(self, args: SpawnArgs) -> None:
        """Kill what still runs on the granted slots, and older attempts of the job, before anything starts."""
        slots = {r.slot for r in args.ranks}
        doomed = [p for p in self.procs.values() if p.alive and (
            p.ref.slot in slots or (p.job_id == args.job_id and p.attempt != args.attempt))]
        for p in doomed:
            self.exits.stopping(p.job_id, p.attempt)
            log.warning("killing a rank whose slot was granted again", job_id=p.job_id, attempt=p.attempt,
                        rank=p.ref.rank, slot=p.ref.slot)
            signal_rank(p, signal.SIGKILL)
        if doomed:  # the slots are free once the processes are gone; their watchers record the exits meanwhile
            await asyncio.wait([asyncio.ensure_future(p.proc.wait()) for p in doomed])

    def _write_spec(self, args: SpawnArgs) -> Path:
        path = self.paths.spec(args.job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(spec_toml(args.spec))
        os.replace(tmp, path)
        return path

    async def _start_rank(self, args: SpawnArgs, ref: SlotRef, spec_file: Path, restore: Path | None,
                          fired: frozenset[int], command: tuple[list[str], Path]) -> RankProc:
        env = rank_env_of(args, ref, spec_file, restore, fired, node=self.node, paths=self.paths, launch=self.launch,
                          link=self.links.address if self.links is not None else "")
        cmd, cwd = command
        log_path = self.paths.log(args.job_id, args.attempt, ref.rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, out = os.pipe()  # the rank's stdout and stderr, read by its OutputPump
        try:
            proc = await self.standbys.warm_start(cmd, env, cwd, out, ref.rank) if self.standbys else None
            if proc is not None:
                self.going[proc.pid] = asyncio.get_running_loop().create_future()
            else:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_agent(os.getpid()))
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(out)
        self.pids[proc.pid] = (args.job_id, args.attempt, ref.rank)
        if (known := self._pid_known.pop(proc.pid, None)) is not None and not known.done():
            known.set_result(None)
        pump = OutputPump(read_end, log_path, store_publisher(self.store), job_id=args.job_id, attempt=args.attempt,
                          rank=ref.rank, node=self.node, producer=self.producer)
        return RankProc(job_id=args.job_id, attempt=args.attempt, ref=ref, proc=proc, cause=args.grant_id,
                        restore=args.restore if restore is not None else None, output=asyncio.create_task(pump.run()),
                        code=args.spec.entrypoint.code.removeprefix("sha256:") if args.spec.entrypoint else "")

    def speaks_for(self, beat: LocalBeat, pid: int) -> bool:
        """Whether process `pid` is the rank `beat` claims to be (a heartbeat relayed for anyone else is refused)."""
        ok = self.pids.get(pid) == (beat.job_id, beat.attempt, beat.rank)
        if ok:  # the steps a rank reports this way (--step-reports rank0) count as recorded (_persist)
            key = (beat.job_id, beat.attempt, beat.rank)
            self.beat_steps[key] = beat.step
            if beat.step_time_s > 0:  # a beat's step counts from before the first step; its time only after one
                self.beat_stepped.add(key)
        if ok and beat.step >= 0:  # past its restore (a resumed rank's step) or its first step: the start is done
            self._got_going(pid)
        return ok

    def _rollback_ready(self, job_id: str, checkpoint_id: str, path: str, problem: str) -> None:
        if self.links is not None:
            self.links.rollback_ready(job_id, checkpoint_id, path, problem)

    async def claims(self, hello: ranklink.Hello, pid: int, wait_s: float = 60.0) -> bool:
        """Whether process `pid` is the rank its link says it is. A fast rank can connect before its start is
        recorded here (a cold start's exec returns after the child runs): wait for that, then judge."""
        if pid not in self.pids:
            known = self._pid_known.setdefault(pid, asyncio.get_running_loop().create_future())
            try:
                async with asyncio.timeout(wait_s):
                    await asyncio.shield(known)
            except TimeoutError:
                self._pid_known.pop(pid, None)
                return False
        return self.pids.get(pid) == (hello.job_id, hello.attempt, hello.rank)

    def _got_going(self, pid: int) -> None:
        if (going := self.going.pop(pid, None)) is not None and not going.done():
            going.set_result(None)

    async def _not_started(self, args: SpawnArgs, reason: str, *, unrunnable: bool = False,
                           error: str = "") -> list[Emit]:
        log.error("ranks not started", job_id=args.job_id, attempt=args.attempt, reason=reason)
        exits = [RankExit(rank=ref.rank, exit_code=START_FAILED_EXIT, cause=reason, unrunnable=unrunnable,
                          error=error, early=bool(error)) for ref in args.ranks]
        await self.exits.record(args.job_id, args.attempt, exits, args.grant_id)
        return []

    # -- watching and stopping -----------------------------------------------------------------------

    async def _watch(self, p: RankProc) -> None:
        detached(self.producer, job_id=p.job_id, attempt=p.attempt, rank=p.ref.rank)
        code = await p.proc.wait()
        self.pids.pop(p.proc.pid, None)
        self._got_going(p.proc.pid)  # gone before it got going: the refill waits no longer for it
        if p.output is not None:  # its last lines: in the log file and on their way to FD_LOGS
            await asyncio.wait({p.output}, timeout=OUTPUT_DRAIN_S)
        if p.shutdown and code in (0, nl.STOPPED_EXIT):
            # The agent stopped it (it checkpoints and exits on SIGTERM): recorded as the signal that ended it.
            code = -signal.SIGTERM
        log.info("rank exited", exit_code=code, returncode=p.proc.returncode)
        key = (p.job_id, p.attempt, p.ref.rank)
        told = await self.links.told(key, key in self.beat_stepped) if self.links is not None else dict(NOT_TOLD)
        self.beat_stepped.discard(key)
        tail = ""
        if code != 0 or told["unlinked"]:
            tail = await asyncio.to_thread(last_lines, self.paths.log(p.job_id, p.attempt, p.ref.rank))
        if code != 0 and not told["error"]:
            told["error"] = error_of(tail)
        persisted, newest = await self._persist(p) if code != 0 and self.paths.snapshots is not None else ("", None)
        if code == nl.RESTORE_REFUSED_EXIT and p.restore is not None:
            await self.exits.rejected(p.job_id, p.attempt, p.restore,
                                      f"rank {p.ref.rank} refused it when loading: {tail}", p.cause)
        exit_ = RankExit(rank=p.ref.rank, exit_code=code, cause=tail, planned=p.shutdown, persisted=persisted,
                         persisted_at=newest, **told)
        await self.exits.record(p.job_id, p.attempt, [exit_], p.cause)
        self.procs.pop((p.job_id, p.attempt, p.ref.rank), None)
        if not any((q.job_id, q.attempt) == (p.job_id, p.attempt) for q in self.procs.values()):
            self.exits.forget(p.job_id, p.attempt)
            if self.relay is not None:
                self.relay.release(p.job_id, p.attempt)
            await self.shipper.finish(p.job_id, p.attempt)  # what the last of them staged on its way out

    async def _persist(self, p: RankProc) -> tuple[Persisted, tuple[int, int] | None]:
        """A rank gone without finishing: its newest snapshot newer than its own checkpoints goes to the store
        (staged as the rank would have; the shipper uploads it), before its exit is recorded."""
        assert self.paths.snapshots is not None
        key = (p.job_id, p.attempt, p.ref.rank)
        staged = self.links.staged.get(key) if self.links is not None else None
        # a snapshot of step N is kept only if the rank's record of step N-1 reached this agent: a history never
        # resumes past a step it holds no record of (the rank's last report can die with it)
        reported = self.links.stepped.get(key, -1) if self.links is not None else -1
        reported = max(reported, self.beat_steps.pop(key, -1)) if reported < 0 else reported
        return await snapshots.persist(self.paths.snapshots, self.store, p.job_id, p.attempt, p.ref.rank, staged,
                                       reported, node=self.node, producer=self.producer)

    def stop(self, job_id: str, attempt: int, reason: str, *, immediate: bool = False, shutdown: bool = False) -> None:
        """SIGTERM the attempt's ranks here (they checkpoint and exit), SIGKILL whatever outlives the grace."""
        targets = [p for p in self.procs.values() if p.job_id == job_id and p.attempt == attempt and p.alive]
        if targets:
            self.exits.stopping(job_id, attempt)
        for p in targets:
            p.shutdown = p.shutdown or shutdown
            signal_rank(p, signal.SIGKILL if immediate else signal.SIGTERM)
        if targets:
            log.info("stopping ranks", job_id=job_id, attempt=attempt, reason=reason, immediate=immediate,
                     ranks=[p.ref.rank for p in targets])
        if targets and not immediate:
            timer = asyncio.create_task(self._kill_after(targets, self.launch.grace_s))
            self.timers.add(timer)
            timer.add_done_callback(self.timers.discard)

    async def _kill_after(self, targets: list[RankProc], grace_s: float) -> None:
        detached(self.producer)
        await asyncio.sleep(grace_s)
        for p in targets:
            if p.alive:
                log.warning("rank outlived its grace period; killing it", job_id=p.job_id, attempt=p.attempt,
                            rank=p.ref.rank, grace_s=grace_s)
                signal_rank(p, signal.SIGKILL)

    async def shutdown(self, wait_s: float) -> None:
        """Stop every rank (SIGTERM, grace, SIGKILL) and wait up to `wait_s` for their exits to be recorded."""
        for job_id, attempt in {(p.job_id, p.attempt) for p in self.procs.values()}:
            self.stop(job_id, attempt, "the agent is stopping", shutdown=True)
        self.cache.cancel_all()
        if self.standbys is not None:
            await close_within("standby pool", self.standbys.close())
        watchers = [p.watcher for p in self.procs.values() if p.watcher is not None]
        if watchers:
            _, pending = await asyncio.wait(watchers, timeout=wait_s)
            if pending:  # the broker is away: the next agent here records these exits (agent.reconcile)
                log.error("exits not recorded before the agent stopped", ranks=len(pending))
                for watcher in pending:
                    watcher.cancel()
        for timer in list(self.timers):
            timer.cancel()
        await self.exits.close()
        await self.shipper.close()
