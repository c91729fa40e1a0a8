"""One seeded run: the services, node agents and jobs on the simulated broker, a schedule of faults drawn from the
seed, and the clock advanced in fixed turns until every job ended or the bound passed. Same seed, same run."""

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flightdeck.events import codec, subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointRejected, CheckpointScrubbed
from flightdeck.events.findings import StragglerDetected
from flightdeck.events.fleet import NodeRegistered, SelfCheckPassed
from flightdeck.events.history import append_to_job
from flightdeck.events.job import JobCompleted, JobSubmitted, RankExit, exits_record
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import MemoryStore
from flightdeck.services.agent import core as agent_core
from flightdeck.services.agent.spawner import START_FAILED_EXIT
from flightdeck.services.archiver import core as archiver_core
from flightdeck.services.archiver.service import archive
from flightdeck.services.checkpoints import core as checkpoints_core
from flightdeck.services.checkpoints.state import CommitArgs, DeleteArgs, ScrubArgs
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.health.core import core_service as health_core
from flightdeck.services.resharder.core import core_service as resharder_core
from flightdeck.services.resources.core import core_service as resources_core
from flightdeck.services.scheduler.core import core_service as scheduler_core
from flightdeck.services.tools.explore.broker import SimBroker
from flightdeck.services.tools.explore.objects import SimObjects
from flightdeck.services.tools.explore.ranks import Clock, Ranks
from flightdeck.services.tools.explore.shell import CRASH_POINTS, SimShell

TURN_S = 0.1
NODES = ("n0", "n1", "n2")
PROCESSES = ("scheduler", "resources", "health", "checkpoints", *(f"agent-{node}" for node in NODES))
SIDE_PROCESSES = ("resharder", "archiver")  # crashed by crash_side (PROCESSES as older seeds drew them)
IDLE_LOST_S = 3.0  # an idle agent beats every heartbeat interval (0.5 s): six missed, as live (5 s, 30 s)
ARCHIVE_EVERY_S = 3.0  # a running job's telemetry is archived this often: a few segments before it ends
SLOTS = 2
FAULT_KINDS_V1 = ("crash", "lost_ack", "stale_restart", "broker_restart", "rank_crash", "rank_kill", "rank_term",
                  "rank_hang", "spike", "agent_vanish", "poison")  # a seed's schedule before "glitch" was drawn
# glitch: one rank's loss spikes for 3 steps of its current run and never again (a fault that passed, as a faulty
# device's): a re-run does not repeat it, so its diagnosis is hardware
FAULT_KINDS_V2 = (*FAULT_KINDS_V1, "glitch")
# agent_freeze: a node's agent stops (SIGSTOP, a long swap or I/O stall) for longer than the lost deadline while its
# ranks train on, and resumes to find its node declared lost and its ranks replaced (issue 51): it must fence them
# and join again, and what it ships late for them must be refused
# store_blind: a node's agent sees another object store from then on (a missing mount, wrong credentials): every
# restore it is given from the store it rejects, though the store holds it intact (issue 51)
# store_full: the object store refuses every write from then on (a full or read-only store): every commit fails
FAULT_KINDS_V3 = (*FAULT_KINDS_V2, "agent_freeze", "store_blind")
FAULT_KINDS_V4 = (*FAULT_KINDS_V3, "store_full")
# crash_side: the resharder or the archiver crashes at one of the shell loop's crash points
# age_out: the telemetry stream's oldest messages age out (its limits): what the archiver had not read is gone, and
# a job's history must say where (HistoryArchived.lost_from..lost_to), never hold less without saying so
FAULT_KINDS_V5 = (*FAULT_KINDS_V4, "crash_side", "age_out")
# store_stale: a node's agent sees the object store as it was (a cache or replica that stopped syncing): restores of
# checkpoints committed since are missing there, older ones are found
# store_refusing: a node's agent can no longer write the object store (its credentials read-only, its mount full):
# every upload from it fails, the other nodes' go on
# store_elsewhere: a node's agent writes to another store and reports its shards stored (a wrong mount or bucket):
# the checkpoint service's read of the store contradicts it, and the node, not the store, is the suspect
FAULT_KINDS = (*FAULT_KINDS_V5, "store_stale", "store_refusing", "store_elsewhere")
POLICY = PolicySpec(heartbeat_interval_s=0.5, heartbeat_misses=4, hang_min_s=3.0, max_restarts=8, spike_warmup=8,
                    spike_window=12, rollback_steps_back=5, rollback_skip_batches=4, commit_wait_s=2.0,
                    max_skip_fraction=1.0,  # no operator answers a pause here: every spike rolls back
                    spike_diagnosis=True)  # its re-run is a window where faults land too
# How long after the last fault every job must have ended: the slowest chain of findings the policy allows (a rank
# hung after its last step is judged after startup_grace_s, and its restart granted to a node whose agent vanished
# while idle waits as long again for a start that never comes: soak seed 50142328), plus a minute to finish.
SETTLE_S = 2 * POLICY.startup_grace_s + 60.0


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    target: str = ""  # a service, a node, or a job
    detail: str = ""  # a crash point, a rank

    def __str__(self) -> str:
        return f"{self.at:.1f}s {self.kind} {self.target} {self.detail}".rstrip()


@dataclass
class Plan:
    """What a seed draws: the jobs and the fault schedule."""

    seed: int
    jobs: list[JobSpec]
    faults: list[Fault]
    faults_until: float
    bound_s: float


def plan(seed: int, *, num_faults: int | None = None, kinds: Sequence[str] = FAULT_KINDS) -> Plan:
    rng = random.Random(seed)
    jobs = [JobSpec(name=f"job{i}", slots=2, policy=POLICY,
                    train=TrainSpec(steps=rng.choice((60, 90, 120)), checkpoint_every=rng.choice((5, 10, 20)),
                                    data="synthetic"))
            for i in range(rng.choice((1, 2, 2, 3)))]
    until = 15.0  # jobs run 6-12 s of simulated time undisturbed: faults land while they train
    n = rng.randint(1, 6) if num_faults is None else num_faults
    faults = []
    for _ in range(n):
        kind = rng.choice(list(kinds))
        at = round(rng.uniform(0.5, until), 1)
        match kind:
            case "crash" | "lost_ack" | "stale_restart":
                target = rng.choice(PROCESSES)
                faults.append(Fault(at, kind, target, rng.choice(CRASH_POINTS) if kind == "crash" else ""))
            case "rank_crash" | "rank_kill" | "rank_term" | "rank_hang" | "spike" | "poison" | "glitch":
                faults.append(Fault(at, kind, f"job{rng.randrange(len(jobs))}", str(rng.randrange(2))))
            case "agent_vanish" | "store_blind" | "store_stale" | "store_refusing" | "store_elsewhere":
                faults.append(Fault(at, kind, rng.choice(NODES)))
            case "agent_freeze":
                faults.append(Fault(at, kind, rng.choice(NODES), f"{rng.uniform(1.0, 8.0):.1f}"))
            case "crash_side":
                faults.append(Fault(at, "crash", rng.choice(SIDE_PROCESSES), rng.choice(CRASH_POINTS)))
            case "age_out":
                faults.append(Fault(at, kind, detail=f"{rng.uniform(0.2, 0.9):.2f}"))
            case _:
                faults.append(Fault(at, kind))
    faults.sort(key=lambda f: f.at)
    # One node lost for good at most, vanished or blind to the store: the fleet must keep room for every job (3 nodes
    # x 2 slots, jobs of 2). Seed 257 drew two blind nodes and a vanished one, and its job had nowhere to run.
    vanished = [f for f in faults if f.kind in ("agent_vanish", "store_blind", "store_stale")][1:]
    faults = [f for f in faults if f not in vanished]
    return Plan(seed=seed, jobs=jobs, faults=faults, faults_until=until, bound_s=until + SETTLE_S)


@dataclass
class Run:
    """A finished run: the store holding its whole history, and what the simulation knows that no record says."""

    plan: Plan
    store: MemoryStore
    ranks: Ranks
    job_ids: list[str]
    ended_at: float
    shells: dict[str, SimShell] = field(default_factory=dict)
    poison_ids: set[str] = field(default_factory=set)
    objects: SimObjects = field(default_factory=SimObjects)  # the archived segments
    aged: MemoryStore | None = None  # the store as the streams' limits left it (age_out), for the history's readers


class World:
    """`cores`: a service's core built otherwise than the platform builds it (name -> factory), e.g. another
    policy, or a broken core that shows what the invariants catch."""

    def __init__(self, p: Plan, cores: dict[str, Any] | None = None) -> None:
        self.plan = p
        self.cores = cores or {}
        self.clock = Clock()
        self.store = MemoryStore(clock=self.clock)
        self.broker = SimBroker(self.store)
        self.ranks = Ranks(self.store, self.clock)
        self.rng = random.Random(p.seed * 7919 + 1)
        self.n = 0
        self.shells: dict[str, SimShell] = {}
        self.restart_at: dict[str, float] = {}
        self.thaw_at: dict[str, float] = {}  # node -> when its frozen agent resumes
        self.frozen_at: dict[str, float] = {}  # ... and when it froze
        self.blind: set[str] = set()  # nodes whose agent cannot read the platform's object store
        self.stale: dict[str, float] = {}  # node -> since when its agent's view of the store stopped moving
        self.elsewhere: set[str] = set()  # nodes whose agent writes to another store (store_elsewhere)
        self.committed_at: dict[tuple[str, str], float] = {}  # (job, checkpoint id) -> when its commit was stored
        self.full = False  # the object store refuses every write
        self.job_ids: list[str] = []
        self.poison_ids: set[str] = set()
        self.objects = SimObjects()
        self.aged = self.store.view()  # the streams as their limits leave them: what the archiver reads (age_out)
        for build in (scheduler_core, resources_core, lambda: health_core(tick_s=0.5, idle_lost_s=IDLE_LOST_S),
                      self._checkpoints, resharder_core, self._archiver):
            self._add(build)
        for node in NODES:
            self._add(lambda node=node: agent_core.core_service(node, {k: self._agent_effect(node, k)
                                                                        for k in agent_core.EFFECTS}))
            self.shells[f"agent-{node}"].on_crash = functools.partial(self.ranks.agent_died, node)

    def _ids(self) -> int:
        self.n += 1
        return self.n

    def _add(self, build: Any) -> None:
        name = build().name
        shell = SimShell(self.cores.get(name, build), self.store, self.broker, self.clock, self._effect, self._ids)
        self.shells[shell.name] = shell

    def _checkpoints(self) -> Service[Any]:
        async def never(args: Any) -> list[Emit]:
            raise AssertionError("effects run through World._effect")
        kinds = (checkpoints_core.COMMIT, checkpoints_core.DELETE, checkpoints_core.SCRUB)
        return checkpoints_core.core_service({kind: never for kind in kinds})

    def _archiver(self) -> Service[Any]:
        async def never(args: Any) -> list[Emit]:
            raise AssertionError("effects run through World._effect")
        return archiver_core.core_service({archiver_core.ARCHIVE: never}, every_s=ARCHIVE_EVERY_S, tick_s=1.0)

    def _agent_effect(self, node: str, kind: str) -> Any:
        async def never(args: Any) -> list[Emit]:
            raise AssertionError(f"effects run through World._effect ({node} {kind})")
        return never

    async def _effect(self, service: str, effect: Effect) -> Sequence[Emit]:
        """The effects' I/O, simulated: a commit is as the uploader records it; an agent starts or stops ranks."""
        args = effect.args
        if isinstance(args, CommitArgs) and self.full:  # as uploader.commit when the store refuses its writes
            failed = CheckpointFailed(job_id=args.job_id, step=args.step, checkpoint_id=args.checkpoint_id, store=True,
                                      reason=f"{args.checkpoint_id}: commit failed: OSError: [Errno 28] No space left "
                                             "on device", schema_version=2)
            return [Emit(subjects.job(args.job_id, "CheckpointFailed"), failed)]
        misdirected = sorted({r.node for r in args.ranks} & self.elsewhere) if isinstance(args, CommitArgs) else []
        if isinstance(args, CommitArgs) and misdirected:  # as uploader.commit when its read-back finds no shard
            failed = CheckpointFailed(
                job_id=args.job_id, step=args.step, checkpoint_id=args.checkpoint_id, store=True, node=misdirected[0],
                reason=f"{args.checkpoint_id}: shard 'r0.bin' (stored by node {misdirected[0]}) is not in the store, "
                       "though its agent reported it stored", schema_version=3)
            return [Emit(subjects.job(args.job_id, "CheckpointFailed"), failed)]
        if isinstance(args, CommitArgs):
            self.committed_at[(args.job_id, args.checkpoint_id)] = self.clock()
            ev = CheckpointCommitted(job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step,
                                     world_size=args.world_size, uri=f"sim:///{args.job_id}/{args.checkpoint_id}",
                                     bytes=len(args.ranks), data=args.data, manifest_sha256="0" * 64,
                                     attempt=args.attempt, timeline=args.timeline, from_memory=args.from_memory)
            return [Emit(subjects.job(args.job_id, "CheckpointCommitted"), ev)]
        if isinstance(args, DeleteArgs):
            return []
        if isinstance(args, archiver_core.Ask):  # the archiver's own code, on the simulated stores; no waiting for
            return await archive(self.aged, self.objects, args, quiet_s=0.0, wait_max_s=0.0)  # quiet: SETTLE_S
        if isinstance(args, ScrubArgs):  # the simulated store holds every committed set as it was committed
            read = CheckpointScrubbed(job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step, bytes=1,
                                      seconds=0.0, claim_node=args.claim_node, claim_cause=args.claim_cause,
                                      schema_version=2 if args.claim_node else 1)
            return [Emit(subjects.job(args.job_id, "CheckpointScrubbed"), read)]
        node = service.removeprefix("agent-")
        if isinstance(args, agent_core.SpawnArgs) and args.restore is not None and not args.restore.from_memory \
                and (node in self.blind or self.committed_at.get((args.job_id, args.restore.checkpoint_id), 0.0)
                     > self.stale.get(node, float("inf"))):
            await self._reject(node, args)
        elif isinstance(args, agent_core.SpawnArgs):
            restore = (args.restore.checkpoint_id, args.restore.step) if args.restore is not None else None
            await self.ranks.spawn(node, args.job_id, args.attempt, [r.rank for r in args.ranks], args.world_size,
                                   args.spec.train.steps, args.spec.train.checkpoint_every, restore,
                                   [tuple(w) for w in args.skips], args.grant_id)  # type: ignore[misc]
        elif isinstance(args, agent_core.StopArgs):
            await self.ranks.stop(node, args.job_id, args.attempt, immediate=args.immediate)
        elif isinstance(args, agent_core.TellArgs) and args.command:
            self.ranks.tell(node, args.job_id, args.attempt, codec.decode(args.command))
        elif isinstance(args, agent_core.RejoinArgs):  # as spawner.fence_and_rejoin: fence, then register again
            for job_id, attempt in sorted(self.ranks.attempts):
                await self.ranks.stop(node, job_id, attempt, immediate=True)
            return [Emit(subjects.node(node, "NodeRegistered"), NodeRegistered(node=node, kind="cpu", slots=SLOTS)),
                    Emit(subjects.node(node, "SelfCheckPassed"), SelfCheckPassed(node=node, seconds=1.0))]
        elif isinstance(args, agent_core.SelfCheckArgs):  # the simulated hardware is sound
            return [Emit(subjects.node(node, "SelfCheckPassed"), SelfCheckPassed(node=node, seconds=1.0))]
        return []

    async def _reject(self, node: str, args: agent_core.SpawnArgs) -> None:
        """As the spawner when the store it sees lacks the restore point: CheckpointRejected, then its ranks' exits
        as not started (services/agent/spawner.py, exits.py)."""
        assert args.restore is not None
        n, producer = self._ids(), f"agent-{node}"
        cid = args.restore.checkpoint_id
        await append_to_job(self.store, CheckpointRejected(
            job_id=args.job_id, checkpoint_id=cid, step=args.restore.step, attempt=args.attempt, node=node,
            cause=f"checkpoint {args.job_id}/{cid} has no manifest", event_id=f"reject-{node}-{n}",
            occurred_at=self.clock(), producer=producer))
        exits = [RankExit(rank=r.rank, exit_code=START_FAILED_EXIT, persisted="none") for r in args.ranks]
        await append_to_job(self.store, exits_record(exits, job_id=args.job_id, node=node, attempt=args.attempt,
                                                     event_id=f"exit-{node}-{n}", occurred_at=self.clock(),
                                                     producer=producer))

    async def _register(self, node: str, *, passed: bool = False) -> None:
        """NodeRegistered, and after a restart its self-check's SelfCheckPassed (what lifts a loss cordon)."""
        n = self._ids()
        await self.store.append(subjects.node(node, "NodeRegistered"),
                                NodeRegistered(node=node, kind="cpu", slots=SLOTS, event_id=f"reg-{node}-{n}",
                                               occurred_at=self.clock(), producer=f"agent-{node}"))
        if passed:
            await self.store.append(subjects.node(node, "SelfCheckPassed"),
                                    SelfCheckPassed(node=node, seconds=1.0, event_id=f"selfcheck-{node}-{n}",
                                                    occurred_at=self.clock(), producer=f"agent-{node}"))

    async def run(self) -> Run:
        for shell in self.shells.values():
            await shell.start()
        for node in NODES:
            await self._register(node)
        for i, spec in enumerate(self.plan.jobs):
            job_id = f"{spec.name}-{i:06d}"
            self.job_ids.append(job_id)
            await append_to_job(self.store, JobSubmitted(job_id=job_id, spec=spec, event_id=f"cli-{job_id}",
                                                         occurred_at=self.clock(), producer="cli"))
        faults = list(self.plan.faults)
        start = self.clock()
        beat_due = 0.0
        turn = 0
        while self.clock() - start < self.plan.bound_s:
            turn += 1
            self.clock.t += TURN_S
            elapsed = self.clock() - start
            while faults and faults[0].at <= elapsed:
                await self._inject(faults.pop(0))
            for node, at in list(self.thaw_at.items()):
                if self.clock() >= at:
                    await self.ranks.thaw(node, self._relayed(node, self.thaw_at.pop(node)))
            for name, shell in self.shells.items():  # a crashed process is restarted by its supervisor, later
                gone = name.removeprefix("agent-") in self.ranks.nodes_down
                if not shell.up and name not in self.restart_at and not gone:
                    self.restart_at[name] = self.clock() + self.rng.uniform(0.3, 3.0)
            for name, at in list(self.restart_at.items()):
                if self.clock() >= at:
                    del self.restart_at[name]
                    await self.shells[name].start()
                    if name.startswith("agent-"):  # as services/agent/main.py at every start: reconcile, register
                        await self.ranks.agent_started(name.removeprefix("agent-"))
                        await self._register(name.removeprefix("agent-"), passed=True)
            if self.clock() >= beat_due:
                beat_due = self.clock() + POLICY.heartbeat_interval_s
                for node in NODES:
                    if node not in self.ranks.nodes_down and node not in self.ranks.frozen:
                        await self.ranks.beats(node, POLICY.heartbeat_interval_s)
            for a in list(self.ranks.attempts.values()):
                await self.ranks.advance(a)
            order = list(self.shells.values())
            self.rng.shuffle(order)  # services run concurrently: any interleaving of their inputs
            for shell in order:
                node = shell.name.removeprefix("agent-")
                if node in self.ranks.nodes_down or node in self.ranks.frozen:
                    continue
                await shell.turn()
            if turn % 10 == 0:
                self.broker.flush()
            if elapsed > self.plan.faults_until and self._all_ended() and self._quiet():
                break
        return Run(self.plan, self.store, self.ranks, self.job_ids, self.clock() - start, self.shells, self.poison_ids,
                   self.objects, self.aged)

    def _all_ended(self) -> bool:
        """Every job ended, and its history archived whole (the archiver's final segments recorded)."""
        scheduler, archiver = self.shells["scheduler"], self.shells["archiver"]
        return scheduler.up and archiver.up and all(j in scheduler.folder.state.ended for j in self.job_ids) \
            and all(j in archiver.folder.state.done for j in self.job_ids)

    def _quiet(self) -> bool:
        """Every live service has folded every input it reads."""
        return all(s.up and self.broker.deliver_peek(s.consumer) is None for s in self.shells.values()
                   if s.name.removeprefix("agent-") not in self.ranks.nodes_down)

    async def _inject(self, f: Fault) -> None:
        job = next((j for j in self.job_ids if j.startswith(f"{f.target}-")), "")
        attempt = self._newest(job) if job else None
        match f.kind:
            case "crash" if self.shells[f.target].up:
                self.shells[f.target].crash_at = f.detail  # at that point of the next input it takes
            case "lost_ack":
                self.shells[f.target].lose_ack = True
            case "stale_restart" if self.shells[f.target].up:
                shell = self.shells[f.target]
                shell.crash()
                shell.stale_start = True
            case "broker_restart":
                self.broker.restart()
            case "rank_crash" | "rank_kill" if attempt is not None:
                rank = int(f.detail) % attempt.world_size
                if rank in attempt.alive:
                    await self.ranks.exit(attempt, [rank], 3 if f.kind == "rank_crash" else -9)
            case "rank_term" if attempt is not None:
                attempt.sigterm = True
            case "rank_hang" if attempt is not None:
                attempt.hung.add(int(f.detail) % attempt.world_size)
            case "spike" if attempt is not None:
                self.ranks.spikes[job] = (attempt.next_batch + 2, attempt.next_batch + 5)
            case "glitch" if attempt is not None:
                attempt.glitch = (attempt.timeline, attempt.step + 2, attempt.step + 5,
                                  int(f.detail) % attempt.world_size)
            case "agent_vanish":
                await self.ranks.node_lost(f.target)
                self.shells[f"agent-{f.target}"].crash()
            case "store_blind":
                self.blind.add(f.target)
            case "store_stale":
                self.stale.setdefault(f.target, self.clock())
            case "store_refusing":
                self.ranks.refusing.add(f.target)
            case "store_elsewhere":
                self.elsewhere.add(f.target)
            case "store_full":
                self.full = True
            case "age_out":  # the oldest part of what the stream holds now
                first, _, last = await self.aged.bounds(subjects.TELEMETRY)
                self.aged.age_out(subjects.TELEMETRY, first + int((last - first) * float(f.detail)))
            case "agent_freeze" if f.target not in self.ranks.nodes_down and self.shells[f"agent-{f.target}"].up:
                self.ranks.frozen.add(f.target)
                self.thaw_at[f.target] = self.clock() + float(f.detail)
                self.frozen_at.setdefault(f.target, self.clock())
            case "poison" if job:
                await self._poison(job)

    def _relayed(self, node: str, thaw: float) -> float:
        """How much of what its ranks sent while its agent was frozen the agent relays: all of it, unless its node
        was declared lost meanwhile, when the rejoin's fence may kill them with their links unread."""
        frozen_at = self.frozen_at.pop(node)
        subject = subjects.node(node, "NodeLost")
        lost = [s for s in self.store.rows(subjects.CONTROL)
                if s.subject == subject and s.event is not None and frozen_at <= s.event.occurred_at <= thaw]
        return self.rng.choice((1.0, 0.0, self.rng.random())) if lost else 1.0

    def _newest(self, job_id: str) -> Any:
        attempts = [a for (j, _), a in self.ranks.attempts.items() if j == job_id and a.alive]
        return max(attempts, key=lambda a: a.attempt) if attempts else None

    async def _poison(self, job_id: str) -> None:
        """What a careless or forging publisher puts on one job's subjects: an unnumbered finding, and an end that
        names another job. Every reader must refuse both, and no other job may notice."""
        other = next((j for j in self.job_ids if j != job_id), "elsewhere-000000")
        straggler = StragglerDetected(job_id=job_id, rank=0, attempt=0, step_time_s=9.0, peer_median_s=1.0, factor=9.0,
                                      event_id=f"poison-{self._ids()}", occurred_at=self.clock(), producer="forger")
        end = JobCompleted(job_id=other, steps=1, event_id=f"poison-{self._ids()}", occurred_at=self.clock(),
                           producer="forger", job_version=10_000)
        for ev, subject in ((straggler, subjects.job(job_id, "StragglerDetected")),
                            (end, subjects.job(job_id, "JobCompleted"))):
            self.poison_ids.add(ev.event_id)
            await self.store.append_bytes(subject, codec.encode(ev), msg_id=ev.event_id)


async def simulate(p: Plan, cores: dict[str, Any] | None = None) -> Run:
    return await World(p, cores).run()
