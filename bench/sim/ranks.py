"""A simulated rank and the node agent that runs it: what the trainer and the agent put on the bus, without torch.

A rank heartbeats every `beat_s` with its last completed step and completes a step every ~`step_s`. In
"rank" mode it publishes what a rank's agent publishes for it (trainer/link.py, services/agent/links.py): RankStarted
once, a Heartbeat per beat and a StepCompleted per step, each its own JetStream message on
`fd.tel.<job>.<rank>.<Type>`. In "node" mode (the real agent's default, with `--step-reports rank0`) the
rank hands each beat to its node agent over the node-local socket, with the code real ranks and agents run
(events/nodelocal.py, services/agent/beats.py), and the agent publishes one RankHeartbeats per node per
interval (events/heartbeats.py); only rank 0 still publishes StepCompleted (the loss curve the spike
detector and postmortems read), and RankStarted stays per rank. A killed rank simply stops: no more beats,
steps or batch entries.
"""

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import Literal

from bench.sim.publisher import Publisher
from flightdeck.events import subjects
from flightdeck.events.heartbeats import LocalBeat, RankHeartbeats
from flightdeck.events.history import append_to_job
from flightdeck.events.job import RankExit, WorkersExited, WorkersStarted, exits_record
from flightdeck.events.nodelocal import BeatChannel
from flightdeck.events.store import EventStore
from flightdeck.events.training import Heartbeat, RankStarted, StepCompleted
from flightdeck.services.agent.beats import BeatRelay
from flightdeck.services.agent.launch import exit_msg_id

Mode = Literal["rank", "node"]


@dataclass(frozen=True)
class Timing:
    beat_s: float = 1.0  # the policy's heartbeat_interval_s
    step_s: float = 2.0  # mean step time


class SimRank:
    def __init__(self, job_id: str, rank: int, attempt: int, node: str, timing: Timing, mode: Mode,
                 pub: Publisher, rng: random.Random, channel: BeatChannel | None = None) -> None:
        self.job_id, self.rank, self.attempt, self.node = job_id, rank, attempt, node
        self.timing, self.mode, self.pub, self.rng = timing, mode, pub, rng
        self.channel = channel  # node mode: the agent's heartbeat socket
        self.alive = True
        self.step = 0  # last completed step, as the trainer's heartbeat reports it (0 before the first)
        self.steps_done = 0
        self.step_time_s = 0.0
        self.beat_at = 0.0  # the rank's last heartbeat (its own clock)
        self._n = 0

    def _env(self) -> dict[str, object]:
        self._n += 1
        return {"job_id": self.job_id, "rank": self.rank, "attempt": self.attempt, "node": self.node,
                "event_id": f"sim:{self.job_id}:{self.attempt}:{self.rank}:{self._n}", "occurred_at": time.time(),
                "producer": "trainer"}

    def _subject(self, name: str) -> str:
        return subjects.telemetry(self.job_id, self.rank, name)

    async def run(self, world_size: int) -> None:
        t, rng = self.timing, self.rng
        await self.pub.publish(self._subject("RankStarted"), RankStarted(
            world_size=world_size, from_step=0, device="sim", **self._env()), droppable=False)  # type: ignore[arg-type]
        now = time.time()
        next_beat = now + rng.uniform(0.0, t.beat_s)  # ranks beat out of phase, as independent processes do
        next_step = now + t.step_s * rng.uniform(0.5, 1.5)
        while self.alive:
            await asyncio.sleep(max(0.0, min(next_beat, next_step) - time.time()))
            if not self.alive:  # killed while asleep: not one more beat
                return
            now = time.time()
            if now >= next_step:
                self.step_time_s = t.step_s * rng.uniform(0.95, 1.05)
                self.step, self.steps_done = self.steps_done, self.steps_done + 1
                next_step = now + self.step_time_s
                if self.mode == "rank" or self.rank == 0:
                    await self._report_step()
            if now >= next_beat:
                self.beat_at = now
                next_beat += t.beat_s
                if self.channel is not None:
                    self.channel.send(LocalBeat(
                        job_id=self.job_id, attempt=self.attempt, rank=self.rank, step=self.step, occurred_at=now,
                        interval_s=t.beat_s, step_time_s=self.step_time_s if self.steps_done else 0.0))
                else:
                    await self.pub.publish(self._subject("Heartbeat"), Heartbeat(
                        step=self.step, interval_s=t.beat_s, **self._env()), entries=1)  # type: ignore[arg-type]

    async def _report_step(self) -> None:
        loss = 1.0 + 2.0 * math.exp(-self.step / 1000.0)  # falls smoothly: no spike to find
        await self.pub.publish(self._subject("StepCompleted"), StepCompleted(
            step=self.step, loss=loss, grad_norm=1.0, lr=1e-3, tokens_per_s=1e5 / self.step_time_s,
            step_time_s=self.step_time_s, **self._env()))  # type: ignore[arg-type]


class SimNode:
    """One node agent: records WorkersStarted/WorkersExited as the real agent does, runs its ranks, and in
    "node" mode batches their heartbeats."""

    def __init__(self, name: str, job_id: str, timing: Timing, mode: Mode, pub: Publisher, store: EventStore,
                 rng: random.Random) -> None:
        self.name, self.job_id, self.timing, self.mode = name, job_id, timing, mode
        self.pub, self.store, self.rng = pub, store, rng
        self.attempt = -1
        self.ranks: dict[int, SimRank] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.relay: BeatRelay | None = None
        self.channel: BeatChannel | None = None

    async def start(self, attempt: int, ranks: list[int], world_size: int) -> None:
        self.attempt = attempt
        if self.mode == "node":
            self.relay = BeatRelay(node=self.name, producer=f"agent-{self.name}", publish=self._publish_batch)
            self.relay.start()
            self.channel = BeatChannel(self.relay.address)
        self.ranks = {r: SimRank(self.job_id, r, attempt, self.name, self.timing, self.mode, self.pub, self.rng,
                                 self.channel) for r in ranks}
        producer = f"agent-{self.name}"
        mid = f"{producer}:start:{self.job_id}:{attempt}"
        await append_to_job(self.store, WorkersStarted(
            job_id=self.job_id, node=self.name, attempt=attempt, ranks=sorted(ranks),
            pids=[100_000 + r for r in sorted(ranks)], event_id=mid, occurred_at=time.time(), producer=producer),
            msg_id=mid)
        self._tasks = [asyncio.create_task(r.run(world_size)) for r in self.ranks.values()]

    def kill(self, rank: int) -> float:
        """Stop one rank dead; returns its last heartbeat time."""
        r = self.ranks[rank]
        r.alive = False
        return r.beat_at

    async def halt(self, exit_code: int) -> WorkersExited | None:
        """The attempt's ranks are gone: stop them; returns their exits to record (one record, as the agent's)."""
        for r in self.ranks.values():
            r.alive = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.relay is not None:
            await self.relay.close()
        if self.channel is not None:
            self.channel.close()
        self.relay = self.channel = None
        producer = f"agent-{self.name}"
        ranks = sorted(self.ranks)
        self.ranks, self._tasks = {}, []
        if not ranks:
            return None
        return exits_record([RankExit(rank=r, exit_code=exit_code) for r in ranks], job_id=self.job_id,
                            node=self.name, attempt=self.attempt, occurred_at=time.time(), producer=producer,
                            event_id=exit_msg_id(producer, self.job_id, self.attempt, ranks[0]))

    async def _publish_batch(self, batch: RankHeartbeats) -> None:
        subject = subjects.telemetry(batch.job_id, batch.rank, "RankHeartbeats")
        await self.pub.publish(subject, batch, entries=len(batch.beats))
