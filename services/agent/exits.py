"""The node agent's exit records: one WorkersExited per node and attempt where it can be.

Ranks the agent stops (a release, a newer grant, its own shutdown) are recorded together once the last of them
has exited, so a restart appends one event per node to the job's history instead of one per rank (at 4,096
ranks one fenced record per rank made most of a 16-21 s restart; node records are now unfenced too, events/
history.py). A rank that
exits by itself is recorded at once, since the scheduler acts on it; exits that come while a record of their
attempt is in flight join the next one.
"""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from flightdeck.events.checkpoint import CheckpointRejected
from flightdeck.events.codec import MAX_CAUSE
from flightdeck.events.history import append_to_job
from flightdeck.events.job import RankExit, exits_record
from flightdeck.events.store import EventStore
from flightdeck.services.agent.core import Restore
from flightdeck.services.agent.launch import exit_msg_id

log = structlog.get_logger("flightdeck.agent.exits")

STOPPED_WAIT_S = 5.0  # the most a stopped rank's exit waits for its node's others (one that will not die)

Key = tuple[str, int]  # (job, attempt)
Retrying = Callable[[str, Callable[[], Awaitable[object]]], Awaitable[object]]


@dataclass
class _Batch:
    exits: list[RankExit] = field(default_factory=list)
    causation_id: str = ""
    landed: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    timer: asyncio.TimerHandle | None = None
    due: bool = False  # its wait for the others ran out: recorded as soon as nothing of its attempt is in flight


class ExitRecorder:
    """Batches a node's exits by attempt. `running(job, attempt)`: the ranks of that attempt still watched here
    (their exits not yet handed over); `retrying` appends until the broker takes it."""

    def __init__(self, store: EventStore, node: str, producer: str, running: Callable[[str, int], set[int]],
                 retrying: Retrying) -> None:
        self.store, self.node, self.producer = store, node, producer
        self.running, self.retrying = running, retrying
        self.stopped: set[Key] = set()  # attempts this agent is stopping: their ranks' exits wait for each other
        self.handed: dict[Key, set[int]] = {}  # ranks whose exits were handed over, recorded or on their way
        self.pending: dict[Key, _Batch] = {}
        self.inflight: dict[Key, asyncio.Task[None]] = {}

    async def rejected(self, job_id: str, attempt: int, checkpoint: Restore, why: str, causation_id: str) -> None:
        """Record a bad checkpoint before the exits it causes: the scheduler then restarts from an older one
        without spending the job's restart budget, and a postmortem names it. Once per attempt and checkpoint."""
        log.error("checkpoint rejected", job_id=job_id, checkpoint_id=checkpoint.checkpoint_id, cause=why)
        mid = f"{self.producer}:reject:{job_id}:{attempt}:{checkpoint.checkpoint_id}"
        event = CheckpointRejected(job_id=job_id, checkpoint_id=checkpoint.checkpoint_id, step=checkpoint.step,
                                   attempt=attempt, node=self.node, cause=why[-MAX_CAUSE:], event_id=mid,
                                   occurred_at=time.time(), causation_id=causation_id, producer=self.producer)
        await self.retrying("recording CheckpointRejected", lambda: append_to_job(self.store, event, msg_id=mid))

    def stopping(self, job_id: str, attempt: int) -> None:
        self.stopped.add((job_id, attempt))

    async def record(self, job_id: str, attempt: int, exits: list[RankExit], causation_id: str) -> None:
        """Record `exits` (ranks of one attempt that ended here); returns once the record holding them landed."""
        key = (job_id, attempt)
        exits = [msgspec.structs.replace(x, cause=x.cause[-MAX_CAUSE:]) for x in exits]
        batch = self.pending.get(key)
        if batch is None:
            batch = self.pending[key] = _Batch(causation_id=causation_id)
            if key in self.stopped:  # a rank that will not die does not hold the others' record forever
                batch.timer = asyncio.get_running_loop().call_later(STOPPED_WAIT_S, self._flush, key, True)
        batch.exits.extend(exits)
        self.handed.setdefault(key, set()).update(x.rank for x in exits)
        landed = batch.landed
        self._flush(key)
        await asyncio.shield(landed)

    def forget(self, job_id: str, attempt: int) -> None:
        """The attempt has no rank left here and nothing to record."""
        key = (job_id, attempt)
        if key not in self.pending and key not in self.inflight:
            self.stopped.discard(key)
            self.handed.pop(key, None)

    def _flush(self, key: Key, force: bool = False) -> None:
        batch = self.pending.get(key)
        if batch is None:
            return
        batch.due = batch.due or force
        if key in self.inflight:
            return  # the record in flight lands first; this one follows it (`_landed`)
        waiting = self.running(*key) - self.handed.get(key, set())
        if key in self.stopped and waiting and not batch.due:
            return  # the others were signalled too: their exits are on their way
        del self.pending[key]
        if batch.timer is not None:
            batch.timer.cancel()
        task = self.inflight[key] = asyncio.create_task(self._append(key, batch))
        task.add_done_callback(lambda _: self._landed(key))

    def _landed(self, key: Key) -> None:
        self.inflight.pop(key, None)
        self._flush(key)

    async def _append(self, key: Key, batch: _Batch) -> None:
        job_id, attempt = key
        try:
            mid = exit_msg_id(self.producer, job_id, attempt, min(x.rank for x in batch.exits))
            event = exits_record(batch.exits, job_id=job_id, node=self.node, attempt=attempt, event_id=mid,
                                 occurred_at=time.time(), causation_id=batch.causation_id, producer=self.producer)
            await self.retrying("recording WorkersExited", lambda: append_to_job(self.store, event, msg_id=mid))
            log.info("exits recorded", job_id=job_id, attempt=attempt, ranks=sorted(x.rank for x in batch.exits))
        except BaseException as exc:
            if not batch.landed.done():
                batch.landed.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            raise
        else:
            batch.landed.set_result(None)

    async def close(self) -> None:
        for batch in self.pending.values():
            if batch.timer is not None:
                batch.timer.cancel()
        for task in list(self.inflight.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
