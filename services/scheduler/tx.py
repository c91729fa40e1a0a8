"""One transition of the scheduler's state: a scratch copy that one input edits, then freezes.

A `Tx` is created for one input and never escapes `transition`, so the core stays a pure function
of (state, event) even though the handlers write to it step by step.
"""

import bisect

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.job import AllocationReleased, ReleaseKind
from flightdeck.services.core import Emit
from flightdeck.services.scheduler.state import Job, NodeView, Phase, State


def queue_key(job: Job) -> tuple[int, int]:
    return (-job.spec.priority, job.order)


class Tx:
    def __init__(self, state: State, at: float) -> None:
        self.settings = state.settings
        self.jobs = dict(state.jobs)
        self.ended = state.ended  # copied on write: jobs end rarely, and this map only grows
        self.queue = list(state.queue)
        self.nodes = state.nodes  # copied on write
        self.next_order = state.next_order
        self.epoch = state.epoch
        self.at = max(state.now, at)
        self.out: list[Emit] = []

    def emit(self, event: JobEvent) -> None:
        self.out.append(Emit(subjects.job(event.job_id, type(event).__name__), event))

    def put(self, job: Job) -> Job:
        self.jobs[job.job_id] = job
        return job

    def update(self, job: Job, **changes: object) -> Job:
        return self.put(msgspec.structs.replace(job, **changes))

    def enqueue(self, job: Job) -> None:
        assert job.job_id not in self.queue, f"{job.job_id} is queued twice"
        keys = [queue_key(self.jobs[j]) for j in self.queue]
        self.queue.insert(bisect.bisect(keys, queue_key(job)), job.job_id)

    def dequeue(self, job_id: str) -> None:
        if job_id in self.queue:
            self.queue.remove(job_id)

    def end(self, job: Job, phase: Phase) -> None:
        self.dequeue(job.job_id)
        del self.jobs[job.job_id]
        self.ended = {**self.ended, job.job_id: phase}

    def set_node(self, name: str, **changes: object) -> NodeView:
        view = msgspec.structs.replace(self.nodes.get(name, NodeView()), **changes)
        self.nodes = {**self.nodes, name: view}
        return view

    def release(self, job: Job, reason: str, kind: ReleaseKind) -> Job:
        """Give back the slots `job` holds or asked for; resources frees them on this event. `kind` says why, for
        the views (a restart after a fault, a grow-back, a preemption, the job's end)."""
        self.emit(AllocationReleased(job_id=job.job_id, attempt=job.attempt, reason=reason, restarts=job.restarts,
                                     kind=kind))
        self.epoch += 1
        return self.update(job, assignments=(), started=frozenset(), exited=frozenset(), requested=False)

    def live(self) -> list[Job]:
        """Jobs holding or asking for slots: the jobs not waiting in the queue."""
        return [j for j in self.jobs.values() if j.requested or j.assignments]

    def freeze(self) -> tuple[State, tuple[Emit, ...]]:
        """The new state and what this input decided."""
        state = State(settings=self.settings, jobs=self.jobs, ended=self.ended, queue=tuple(self.queue),
                      nodes=self.nodes, next_order=self.next_order, epoch=self.epoch, now=self.at)
        return state, tuple(self.out)
