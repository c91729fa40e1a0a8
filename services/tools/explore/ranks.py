"""Simulated node agents' effects and training ranks: what an attempt's ranks do step by step (train, beat, stage
checkpoints, obey commands at step boundaries, exit) and what their agent records, on the simulated store.

As on a real node, a rank's agent is its only link: commands reach rank 0 when its agent's core tells it (the
`tell` effect), and ranks die with their agent (a crashed agent's restart records them as killed)."""

import zlib
from dataclasses import dataclass, field

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import (
    CheckpointStaged,
    DataPosition,
    ShardInfo,
    ShardsUploaded,
    batch_at,
    checkpoint_id,
)
from flightdeck.events.commands import (
    CheckpointRequested,
    PauseRequested,
    ResumeRequested,
    RollbackRequested,
    StopRequested,
)
from flightdeck.events.fleet import AgentAlive
from flightdeck.events.heartbeats import RankBeat, RankHeartbeats
from flightdeck.events.history import append_to_job
from flightdeck.events.job import Persisted, RankExit, WorkersExited, WorkersStarted, exits_record
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.store import MemoryStore
from flightdeck.events.training import RankStarted, RolledBack, SpikeReplayed, StepCompleted

SPIKE_FACTOR = 10.0


@dataclass
class Saved:
    """A checkpoint the ranks staged: what a restore of it loads."""

    step: int
    next_batch: int
    skipped: list[tuple[int, int]]


@dataclass
class Replay:
    command: RollbackRequested
    saved: Saved
    start: int
    until: int
    losses: list[float] = field(default_factory=list)


@dataclass
class Attempt:
    job_id: str
    attempt: int
    world_size: int
    total: int
    checkpoint_every: int
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> node, once its agent started it
    step: int = 0  # steps done: the next step to run
    next_batch: int = 0
    skipped: list[tuple[int, int]] = field(default_factory=list)
    timeline: int = 0
    alive: set[int] = field(default_factory=set)
    hung: set[int] = field(default_factory=set)
    sigterm: bool = False  # from outside the platform: at the next boundary every rank saves and stops
    paused: bool = False
    finished: bool = False  # every step ran and every rank exited 0
    saved_at: int = 0
    inbox: list[Event] = field(default_factory=list)  # commands rank 0's agent passed down, not yet obeyed
    steps_run: int = 0
    replay: "Replay | None" = None  # a rollback's re-run of the spike's batches, as the trainer does it
    glitch: tuple[int, int, int, int] | None = None  # (timeline, first step, end step, rank): a passing fault
    # the boundary before the last step run, (timeline, what it held): the other of a rank's two snapshot slots
    older: tuple[int, Saved] | None = None

    @property
    def running(self) -> bool:
        return len(self.nodes) == self.world_size and bool(self.alive)

    def next_index(self) -> int:
        """As the trainer's cursor (trainer/cursor.py): the batch this step reads, past the skipped windows."""
        index = batch_at(self.next_batch, self.skipped)
        self.next_batch = index + 1
        return index


class Ranks:
    """Every attempt's simulated ranks and the records their agents keep about them."""

    def __init__(self, store: MemoryStore, now: "Clock") -> None:
        self.store, self.now = store, now
        self.attempts: dict[tuple[str, int], Attempt] = {}
        self.saved: dict[tuple[str, str], Saved] = {}  # (job, checkpoint id) -> what it holds
        self.spikes: dict[str, tuple[int, int]] = {}  # job -> batches whose loss spikes
        self.nodes_down: set[str] = set()
        # nodes whose agent is frozen: their ranks train on, but what they send and what their agent would record
        # waits in `held` ((from a rank's link, event)) until it resumes (thaw)
        self.frozen: set[str] = set()
        self.held: dict[str, list[tuple[bool, Event]]] = {}
        self.refusing: set[str] = set()  # nodes whose agent's uploads the store refuses (store_refusing)
        self.orphans: dict[str, list[tuple[Attempt, int]]] = {}  # node -> ranks that died with its agent
        self.n = 0

    def _id(self, what: str) -> str:
        self.n += 1
        return f"sim:{what}:{self.n}"

    async def tel(self, event: RankHeartbeats | StepCompleted | CheckpointStaged | ShardsUploaded | RankStarted
                  | RolledBack | SpikeReplayed, *, link: bool = True) -> None:
        """A rank's event relayed by its agent (`link`), or the agent's own."""
        if event.node in self.frozen:
            self.held.setdefault(event.node, []).append((link, event))
            return
        subject = subjects.telemetry(event.job_id, event.rank, type(event).__name__)
        await self.store.append(subject, event, msg_id=event.event_id)

    async def _record(self, node: str, ev: WorkersExited) -> None:
        """An agent's record of its ranks' exits: once it runs again, if it is frozen."""
        if node in self.frozen:
            self.held.setdefault(node, []).append((False, ev))
            return
        await append_to_job(self.store, ev, msg_id=ev.event_id)

    async def thaw(self, node: str, keep: float) -> None:
        """A frozen agent resumes: what it records itself is relayed, and of what its ranks sent meanwhile the
        first `keep` (a fraction): the rest is lost in the race with the rejoin's fence, which kills the ranks with
        their links unread (as the nemesis saw: issue 51)."""
        self.frozen.discard(node)
        held = self.held.pop(node, [])
        cut = int(keep * sum(1 for link, _ in held if link))
        for link, ev in held:
            if link:
                if cut <= 0:
                    continue
                cut -= 1
            if isinstance(ev, WorkersExited):
                await self._record(node, ev)
            else:
                await self.tel(ev)  # type: ignore[arg-type]

    # -- the agent's effects ---------------------------------------------------------------------------------

    async def spawn(self, node: str, job_id: str, attempt: int, ranks: list[int], world_size: int, total: int,
                    every: int, restore: tuple[str, int] | None, skips: list[tuple[int, int]], grant_id: str) -> None:
        a = self.attempts.get((job_id, attempt))
        if a is None:
            a = self.attempts[(job_id, attempt)] = Attempt(job_id=job_id, attempt=attempt, world_size=world_size,
                                                           total=total, checkpoint_every=every)
            if restore is not None:
                saved = self.saved.get((job_id, restore[0]))
                assert saved is not None, f"restore of an unknown checkpoint {restore}"
                a.step = a.saved_at = saved.step
                a.next_batch, a.skipped = saved.next_batch, list(saved.skipped)
                for start, end in skips:
                    if (start, end) not in a.skipped:
                        a.skipped.append((start, end))
        for r in ranks:
            a.nodes[r] = node
            a.alive.add(r)
        now = self.now()
        started = WorkersStarted(job_id=job_id, node=node, attempt=attempt, ranks=ranks, pids=[1000 + r for r in ranks],
                                 event_id=f"agent-{node}:start:{job_id}:{attempt}", occurred_at=now,
                                 causation_id=grant_id, producer=f"agent-{node}")
        await append_to_job(self.store, started, msg_id=started.event_id)
        for r in ranks:
            await self.tel(RankStarted(job_id=job_id, rank=r, attempt=attempt, node=node, world_size=world_size,
                                       from_step=a.step, device="cpu", event_id=self._id("started"), occurred_at=now))

    async def stop(self, node: str, job_id: str, attempt: int, *, immediate: bool) -> None:
        a = self.attempts.get((job_id, attempt))
        if a is None:
            return
        mine = sorted(r for r in a.alive if a.nodes.get(r) == node)
        await self.exit(a, mine, -9 if immediate else STOPPED_EXIT)

    async def exit(self, a: Attempt, ranks: list[int], code: int, *, record: bool = True) -> None:
        """`ranks` end with `code`; each node's agent records its own (unless it is gone), after persisting the
        snapshot in memory of each rank that did not finish (services/agent/snapshots.py)."""
        a.alive -= set(ranks)
        by_node: dict[str, list[int]] = {}
        for r in ranks:
            by_node.setdefault(a.nodes[r], []).append(r)
        for node, rs in sorted(by_node.items()):
            if not record or node in self.nodes_down:
                continue
            persisted: Persisted = ""
            at: tuple[int, int] | None = None
            if code != 0:
                at = await self._persist(a, node, rs)
                persisted = "staged" if at is not None else "none"
            ev = exits_record([RankExit(rank=r, exit_code=code, persisted=persisted, persisted_at=at) for r in rs],
                              job_id=a.job_id,
                              node=node,
                              attempt=a.attempt, event_id=self._id(f"exit-{node}"), occurred_at=self.now(),
                              producer=f"agent-{node}")
            await self._record(node, ev)

    async def _persist(self, a: Attempt, node: str, ranks: list[int]) -> tuple[int, int] | None:
        """The agent stages its gone ranks' snapshots, newest first: the boundary of the step they were running and
        the one before it (a rank's two slots), each unless its ranks checkpointed that step themselves (or restored
        from it), never a re-run's. Some stores refuse the newer set's shards (drawn from the set's name, so a seed
        runs the same): a set it superseded must then commit. The newest (timeline, step) staged, as the exit says."""
        if a.replay is not None:
            return None
        slots = [] if a.step <= a.saved_at else [(a.timeline, Saved(step=a.step, next_batch=a.next_batch,
                                                                    skipped=list(a.skipped)))]
        if a.older is not None and a.older[0] == a.timeline and a.saved_at < a.older[1].step < a.step:
            slots.append(a.older)
        for i, (timeline, saved) in enumerate(slots):
            cid = checkpoint_id(a.attempt, saved.step, timeline)
            self.saved.setdefault((a.job_id, cid), saved)
            data = DataPosition(next_batch=saved.next_batch, skipped=[list(w) for w in saved.skipped])  # type: ignore[misc]
            now = self.now()
            for r in ranks:
                shards = [ShardInfo(path=f"r{r}.bin", size=1, sha256="0" * 64),
                          ShardInfo(path=f"r{r}.json", size=1, sha256="1" * 64)]
                await self.tel(CheckpointStaged(job_id=a.job_id, rank=r, attempt=a.attempt, node=node,
                                                step=saved.step, world_size=a.world_size, staging_dir="/sim/shm",
                                                shards=shards, data=data, stall_s=0.0, write_s=0.0, timeline=timeline,
                                                from_memory=True, event_id=self._id("persisted"), occurred_at=now),
                               link=False)
            refused = node in self.refusing or (
                i == 0 and len(slots) > 1 and zlib.crc32(f"{a.job_id}:{cid}:{node}".encode()) % 4 == 0)
            await self.tel(ShardsUploaded(job_id=a.job_id, rank=ranks[0], attempt=a.attempt, node=node,
                                          step=saved.step, timeline=timeline, world_size=a.world_size, ranks=ranks,
                                          bytes=len(ranks), seconds=0.0, failed="refused by the store" * refused,
                                          event_id=self._id("uploaded"), occurred_at=now), link=False)
        return (slots[0][0], slots[0][1].step) if slots else None

    def _refusal(self, node: str) -> str:
        """What an upload from `node` fails with ("": stored)."""
        return "OSError: [Errno 30] Read-only file system (store_refusing)" if node in self.refusing else ""

    def tell(self, node: str, job_id: str, attempt: int, command: Event) -> None:
        """A command down rank 0's link: only the agent that runs rank 0 hands it over (the boundary agrees it)."""
        a = self.attempts.get((job_id, attempt))
        if a is not None and a.nodes.get(0) == node and 0 in a.alive:
            a.inbox.append(command)

    def agent_died(self, node: str) -> None:
        """An agent process ended: its ranks die with it (parent-death signal; a link's EOF stops any left)."""
        for a in self.attempts.values():
            gone = sorted(r for r in a.alive if a.nodes.get(r) == node)
            a.alive -= set(gone)
            self.orphans.setdefault(node, []).extend((a, r) for r in gone)

    async def agent_started(self, node: str) -> None:
        """A restarted agent records the ranks an earlier one started and never saw exit (services/agent/main.py
        `reconcile`): killed, one record per attempt."""
        by_attempt: dict[tuple[str, int], list[int]] = {}
        for a, r in self.orphans.pop(node, []):
            by_attempt.setdefault((a.job_id, a.attempt), []).append(r)
        for (job_id, attempt), rs in sorted(by_attempt.items()):
            ev = exits_record([RankExit(rank=r, exit_code=-9, persisted="none", orphaned=True) for r in rs],
                              job_id=job_id, node=node,
                              attempt=attempt,
                              event_id=self._id(f"exit-{node}"), occurred_at=self.now(), producer=f"agent-{node}")
            await append_to_job(self.store, ev, msg_id=ev.event_id)

    async def node_lost(self, node: str) -> None:
        """The agent vanished: its ranks die with it and nothing records them."""
        self.nodes_down.add(node)
        for a in self.attempts.values():
            gone = [r for r in a.alive if a.nodes.get(r) == node]
            await self.exit(a, gone, -9, record=False)

    # -- the ranks --------------------------------------------------------------------------------------------

    async def beats(self, node: str, interval_s: float) -> None:
        """Its ranks' heartbeats, one batch per attempt; an agent that runs none says it is alive (agent/alive.py)."""
        now = self.now()
        if not any(a.nodes.get(r) == node for a in self.attempts.values() for r in a.alive):
            ev = AgentAlive(node=node, interval_s=interval_s, event_id=self._id("alive"), occurred_at=now,
                            producer=f"agent-{node}")
            await self.store.append(subjects.fleet_telemetry(node, "AgentAlive"), ev, msg_id=ev.event_id)
            return
        for a in self.attempts.values():
            mine = sorted(r for r in a.alive if a.nodes.get(r) == node)
            if mine:
                beats = [RankBeat(rank=r, step=a.step - 1, occurred_at=now) for r in mine]
                await self.tel(RankHeartbeats(job_id=a.job_id, rank=mine[0], attempt=a.attempt, node=node,
                                              interval_s=interval_s, beats=beats, event_id=self._id("beats"),
                                              occurred_at=now))

    async def advance(self, a: Attempt) -> None:
        """One step boundary and step of a running attempt, when every rank is there to take part."""
        if not a.running or a.finished or len(a.alive) < a.world_size or a.hung:
            return  # a collective with a peer missing or hung blocks every rank
        if a.replay is not None and a.step >= a.replay.until:
            await self._end_replay(a, a.replay)
        await self._commands(a)
        if not a.alive or a.paused:
            return
        if a.sigterm:  # agreed at the boundary: every rank saves, then stops
            await self._save(a)
            await self.exit(a, sorted(a.alive), STOPPED_EXIT)
            return
        if a.step > 0 and a.step % a.checkpoint_every == 0 and a.saved_at != a.step:
            await self._save(a)
        if a.step >= a.total:
            a.finished = True
            await self.exit(a, sorted(a.alive), 0)
            return
        if a.replay is None:
            a.older = (a.timeline, Saved(step=a.step, next_batch=a.next_batch, skipped=list(a.skipped)))
        index = a.next_index()
        spike = self.spikes.get(a.job_id)
        loss = (2.0 - a.step / (4 * a.total)) * (SPIKE_FACTOR if spike and spike[0] <= index < spike[1] else 1.0)
        if a.replay is not None:  # a re-run's losses go to SpikeReplayed, not the step record
            a.replay.losses.append(loss)
            a.step += 1
            return
        g = a.glitch
        glitched = g is not None and g[0] == a.timeline and g[1] <= a.step < g[2]
        for r in sorted(a.alive):
            mine = loss * SPIKE_FACTOR if glitched and g is not None and r == g[3] else loss
            await self.tel(StepCompleted(job_id=a.job_id, rank=r, attempt=a.attempt, node=a.nodes[r], step=a.step,
                                         loss=mine, grad_norm=1.0, lr=1e-3, tokens_per_s=1000.0, step_time_s=0.1,
                                         event_id=self._id("step"), occurred_at=self.now()))
        a.step += 1
        a.steps_run += 1

    async def _save(self, a: Attempt) -> None:
        if a.replay is not None:  # a re-run's state is never saved
            return
        cid = checkpoint_id(a.attempt, a.step, a.timeline)
        self.saved[(a.job_id, cid)] = Saved(step=a.step, next_batch=a.next_batch, skipped=list(a.skipped))
        a.saved_at = a.step
        now = self.now()
        data = DataPosition(next_batch=a.next_batch, skipped=[list(w) for w in a.skipped])  # type: ignore[misc]
        for r in sorted(a.alive):
            shard = ShardInfo(path=f"__{r}_0.distcp", size=1, sha256="0" * 64)
            await self.tel(CheckpointStaged(job_id=a.job_id, rank=r, attempt=a.attempt, node=a.nodes[r], step=a.step,
                                            world_size=a.world_size, staging_dir="/sim", shards=[shard], data=data,
                                            stall_s=0.0, write_s=0.0, timeline=a.timeline,
                                            event_id=self._id("staged"), occurred_at=now))
        by_node: dict[str, list[int]] = {}
        for r in sorted(a.alive):
            by_node.setdefault(a.nodes[r], []).append(r)
        for node, rs in sorted(by_node.items()):
            await self.tel(ShardsUploaded(job_id=a.job_id, rank=rs[0], attempt=a.attempt, node=node, step=a.step,
                                          timeline=a.timeline, world_size=a.world_size, ranks=rs, bytes=len(rs),
                                          seconds=0.0, failed=self._refusal(node), event_id=self._id("uploaded"),
                                          occurred_at=now))

    async def _commands(self, a: Attempt) -> None:
        while a.inbox and a.alive:
            match a.inbox.pop(0):
                case StopRequested(checkpoint=save):
                    if save:
                        await self._save(a)
                    await self.exit(a, sorted(a.alive), STOPPED_EXIT)
                case RollbackRequested() as rb if rb.attempt == a.attempt:
                    await self._rollback(a, rb)
                case CheckpointRequested():
                    await self._save(a)
                case PauseRequested():
                    a.paused = True
                case ResumeRequested():
                    a.paused = False

    async def _rollback(self, a: Attempt, rb: RollbackRequested) -> None:
        a.replay = None  # a newer rollback ends a re-run under way
        saved = self.saved.get((a.job_id, rb.checkpoint_id))
        if saved is None:
            return
        reached = a.step
        a.step = a.saved_at = saved.step
        a.next_batch, a.skipped = saved.next_batch, list(saved.skipped)
        a.timeline += 1
        if rb.replay and reached > saved.step:
            a.replay = Replay(command=rb, saved=saved, start=saved.step, until=reached)
            return
        await self._land(a, rb)

    async def _end_replay(self, a: Attempt, replay: Replay) -> None:
        a.replay = None
        a.step = a.saved_at = replay.saved.step
        a.next_batch, a.skipped = replay.saved.next_batch, list(replay.saved.skipped)
        for r in sorted(a.alive):
            await self.tel(SpikeReplayed(job_id=a.job_id, rank=r, attempt=a.attempt, node=a.nodes[r],
                                         checkpoint_id=replay.command.checkpoint_id, from_step=replay.start,
                                         losses=replay.losses, seconds=0.1 * len(replay.losses),
                                         event_id=self._id("replayed"), occurred_at=self.now()))
        await self._land(a, replay.command)

    async def _land(self, a: Attempt, rb: RollbackRequested) -> None:
        if rb.skip_to > rb.skip_from and (rb.skip_from, rb.skip_to) not in a.skipped:
            a.skipped.append((rb.skip_from, rb.skip_to))
        for r in sorted(a.alive):
            await self.tel(RolledBack(job_id=a.job_id, rank=r, attempt=a.attempt, node=a.nodes[r],
                                      checkpoint_id=rb.checkpoint_id, to_step=a.step, skip_from=rb.skip_from,
                                      skip_to=rb.skip_to, timeline=a.timeline, event_id=self._id("rolledback"),
                                      occurred_at=self.now()))


class Clock:
    """The simulated clock (seconds)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t
