"""One simulator process: many node agents and their ranks on one asyncio loop and one broker connection.

It follows the job's history like a node agent does (AllocationGranted starts the ranks assigned to its
nodes, after recording the exits of an older attempt's; AllocationReleased stops them) and takes commands
from the harness over a pipe: ("kill", rank) stops a rank dead and answers ("killed", rank, attempt,
last_beat_at, killed_at); ("quit",) ends the process. Every STATS_S it sends ("stats", counters).
"""

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.sim.publisher import Publisher
from bench.sim.ranks import Mode, SimNode, Timing
from flightdeck.events import subjects
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationGranted, AllocationReleased
from flightdeck.services.shell.logging import configure

STATS_S = 1.0
KILLED_EXIT = -9  # an older attempt's ranks are killed at once when a newer one is granted (agentcore)
STOPPED_EXIT = -15  # released: the agent stops them


@dataclass(frozen=True)
class WorkerConfig:
    url: str
    job_id: str
    nodes: tuple[str, ...]
    mode: Mode
    timing: Timing
    seed: int


def main(config: WorkerConfig, conn: Connection) -> None:
    """Process entry point (multiprocessing, spawn)."""
    configure("WARNING")  # the appends' conflict retries are debug chatter at this scale
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(Worker(config, conn).run())


class Worker:
    def __init__(self, config: WorkerConfig, conn: Connection) -> None:
        self.config, self.conn = config, conn
        self.quit = asyncio.Event()
        self.nodes: dict[str, SimNode] = {}
        self.where: dict[int, SimNode] = {}  # rank -> its node, for the current attempt
        self.store: JetStreamStore | None = None

    async def run(self) -> None:
        c = self.config
        store = self.store = await JetStreamStore.connect(c.url, name=f"sim-{c.nodes[0]}", provision=False)
        pub = Publisher(store.js)
        rng = random.Random(c.seed)
        self.nodes = {n: SimNode(n, c.job_id, c.timing, c.mode, pub, store, rng) for n in c.nodes}
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._command)
        stats = asyncio.create_task(self._stats(pub))
        follow = asyncio.create_task(self._follow(store))
        try:
            await self.quit.wait()
        finally:
            loop.remove_reader(self.conn.fileno())
            for task in (stats, follow):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await store.close()

    async def _follow(self, store: JetStreamStore) -> None:
        job = self.config.job_id
        patterns = [subjects.job(job, "AllocationGranted"), subjects.job(job, "AllocationReleased")]
        async for stored in store.follow(subjects.CONTROL, patterns):
            ev = stored.event
            if isinstance(ev, AllocationGranted):
                await self._granted(ev)
            elif isinstance(ev, AllocationReleased):
                await self._stop([n for n in self.nodes.values() if n.attempt == ev.attempt and n.ranks], STOPPED_EXIT)

    async def _stop(self, nodes: list[SimNode], exit_code: int) -> None:
        """Stop the nodes' ranks and record their exits, one record per node as the agent does; each node on its
        own, as separate agents would."""
        store = self.store
        assert store is not None

        async def one(node: SimNode) -> None:
            ev = await node.halt(exit_code)
            if ev is not None:
                await append_to_job(store, ev, msg_id=ev.event_id)

        await asyncio.gather(*(one(n) for n in nodes))

    async def _granted(self, ev: AllocationGranted) -> None:
        mine: dict[str, list[int]] = defaultdict(list)
        for ref in ev.assignments:
            if ref.node in self.nodes:
                mine[ref.node].append(ref.rank)
        await self._stop([n for n in self.nodes.values() if n.ranks and n.attempt < ev.attempt], KILLED_EXIT)
        starting = [(self.nodes[name], ranks) for name, ranks in mine.items()
                    if self.nodes[name].attempt < ev.attempt]  # else the same grant read again
        for node, ranks in starting:
            self.where.update(dict.fromkeys(ranks, node))
        await asyncio.gather(*(node.start(ev.attempt, ranks, len(ev.assignments)) for node, ranks in starting))
        self.conn.send(("started", ev.attempt, len(starting)))

    def _command(self) -> None:
        while self.conn.poll():
            try:
                msg: tuple[Any, ...] = self.conn.recv()
            except EOFError:
                self.quit.set()
                return
            if msg[0] == "kill":
                node = self.where.get(msg[1])
                if node is not None and msg[1] in node.ranks:
                    last = node.kill(msg[1])
                    self.conn.send(("killed", msg[1], node.attempt, last, time.time()))
            elif msg[0] == "quit":
                self.quit.set()

    async def _stats(self, pub: Publisher) -> None:
        while True:
            await asyncio.sleep(STATS_S)
            self.conn.send(("stats", {**pub.counters.snapshot(), "pending": pub.pending}))
