"""One transition of the scheduler's state: a scratch copy that one input edits, then freezes.

A `Tx` is created for one input and never escapes `transition`, so the core stays a pure function
of (state, event) even though the handlers write to it step by step.
"""

import bisect

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.job import AllocationReleased, JobPhaseChanged, ReleaseKind
from flightdeck.services.core import Emit
from flightdeck.services.scheduler.state import ATTEMPT_FIELDS, Job, NodeView, Phase, State


def queue_key(job: Job) -> tuple[int, int]:
    return (-job.spec.priority, job.order)


class Tx:
    def __init__(self, state: State, at: float) -> None:
        self.settings = state.settings
        self.before = state.jobs  # what each job's record said before this input
        self.jobs = dict(state.jobs)
        self.endings: list[JobPhaseChanged] = []
        self.touched: dict[str, None] = {}  # jobs this input changed, in the order first changed
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
        self.touched[job.job_id] = None
        return job

    def update(self, job: Job, **changes: object) -> Job:
        """`job` with `changes`: those of its current attempt's fields (state.Attempt) go to `job.run`."""
        run = {k: changes.pop(k) for k in list(changes) if k in ATTEMPT_FIELDS}
        if run:
            changes["run"] = msgspec.structs.replace(job.run, **run)
        return self.put(msgspec.structs.replace(job, **changes))

    def enqueue(self, job: Job) -> None:
        assert job.job_id not in self.queue, f"{job.job_id} is queued twice"
        keys = [queue_key(self.jobs[j]) for j in self.queue]
        self.queue.insert(bisect.bisect(keys, queue_key(job)), job.job_id)

    def dequeue(self, job_id: str) -> None:
        if job_id in self.queue:
            self.queue.remove(job_id)

    def end(self, job: Job, phase: Phase, why: str) -> None:
        self.dequeue(job.job_id)
        del self.jobs[job.job_id]
        self.ended = {**self.ended, job.job_id: phase}
        self.endings.append(JobPhaseChanged(job_id=job.job_id, phase=phase, attempt=job.attempt,
                                            restarts=job.restarts, reason=why))

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
        return [j for j in self.jobs.values() if j.run.requested or j.run.assignments]

    def record_phases(self) -> None:
        """Record each job whose phase, its reason or its restarts this input changed: after the decisions that
        changed them, so that no handler can move a job without its record saying so."""
        for job_id in self.touched:
            if (job := self.jobs.get(job_id)) is None:
                continue  # it ended: its ending says so
            old = self.before.get(job_id)
            (phase, why), restarts = job.shown, job.restarts
            if old is None or (phase, why, restarts) != (*old.shown, old.restarts):
                self.emit(JobPhaseChanged(job_id=job_id, phase=phase, attempt=job.attempt, restarts=restarts,
                                          reason=why))
        for ending in self.endings:
            self.emit(ending)

    def freeze(self) -> tuple[State, tuple[Emit, ...]]:
        """The new state and what this input decided."""
        if self.settings.phases == "yes":
            self.record_phases()
        state = State(settings=self.settings, jobs=self.jobs, ended=self.ended, queue=tuple(self.queue),
                      nodes=self.nodes, next_order=self.next_order, epoch=self.epoch, now=self.at)
        return state, tuple(self.out)
