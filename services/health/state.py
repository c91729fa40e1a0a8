"""The health monitor's state: what it watches of each job, kept mutable for O(1) per heartbeat (core.py folds it)."""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from flightdeck.events.spec import PolicySpec
from flightdeck.services.health import agents
from flightdeck.services.health.detectors import EVIDENCE_MAX, NonFiniteWatch, RankWatch, StragglerWatch
from flightdeck.services.health.diagnosis import Diagnoses
from flightdeck.services.health.spikes import SpikeWatch


@dataclass(slots=True)
class JobWatch:
    job_id: str
    policy: PolicySpec
    spikes: SpikeWatch
    last_step: int = -1  # the job's final step (train.steps - 1): a rank that reported it is exiting
    attempt: int = -1
    ranks: dict[int, RankWatch] = field(default_factory=dict)
    stopping: bool = False  # the attempt's ranks are being stopped on purpose
    cancelling: bool = False  # a cancel is under way: stays through any later attempt
    paused: bool = False
    nonfinite: NonFiniteWatch = field(default_factory=NonFiniteWatch)
    stragglers: StragglerWatch = field(default_factory=StragglerWatch)
    reported: set[tuple[int, int, str, int]] = field(default_factory=set)
    unrecorded: dict[tuple[int, int], agents.Unrecorded] = field(default_factory=dict)  # (attempt, rank)
    recording: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> its agent's newest exit record
    silent: set[tuple[int, str]] = field(default_factory=set)  # (attempt, node) whose agent fell silent, reported
    diagnoses: Diagnoses = field(default_factory=lambda: Diagnoses(margin=0))
    recent: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # rank -> its newest (step, loss)

    @property
    def quiet(self) -> bool:
        return self.stopping or self.cancelling

    def clone(self) -> "JobWatch":
        return JobWatch(job_id=self.job_id, policy=self.policy, spikes=self.spikes.clone(), last_step=self.last_step,
                        attempt=self.attempt, ranks={rank: r.clone() for rank, r in self.ranks.items()},
                        stopping=self.stopping, cancelling=self.cancelling, paused=self.paused,
                        nonfinite=self.nonfinite.clone(), stragglers=self.stragglers.clone(),
                        reported=set(self.reported), unrecorded=dict(self.unrecorded), recording=dict(self.recording),
                        silent=set(self.silent), diagnoses=self.diagnoses.clone(),
                        recent={rank: deque(q, EVIDENCE_MAX) for rank, q in self.recent.items()})

    def gone(self, r: RankWatch) -> None:
        if not r.gone:
            r.gone = True
            self.stragglers.forget(r.rank)

    def first(self, rank: int, kind: str, episode: int = 0) -> bool:
        """Whether (attempt, rank, kind, episode) is new; remembers it."""
        key = (self.attempt, rank, kind, episode)
        if key in self.reported:
            return False
        self.reported.add(key)
        return True


@dataclass(slots=True)
class State:
    jobs: dict[str, JobWatch] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    now: float = 0.0  # the newest ClockTick's time
    recovered_at: float = 0.0  # the newest end of a broker outage a tick reported: silence counts from then on
    sealed: bool = False
    # node -> (occurred_at, folded) of its agent's newest heartbeat batch, any job: an agent that relays its ranks'
    # beats sends one every interval while it runs ranks, so its silence means the node is lost (agents.silent)
    batches: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Whether the agents of an attempt being stopped are watched for silence (its node lost) until they record its
    # ranks' exits. Histories recorded before (their CoreConfigured lacks STOPPING) replay without it.
    watch_stopping: bool = True
    # Whether a hang waits while a node of its attempt has gone quiet (its loss, the likelier fault, told first).
    # Histories recorded before (their CoreConfigured lacks STRANDED) replay without it.
    stranded_wait: bool = True
    # An idle agent silent this long is lost (agents.idle_silent); 0: idle agents unwatched, as histories recorded
    # before (their CoreConfigured lacks IDLE_LOST).
    idle_lost_s: float = 0.0
    idle: set[str] = field(default_factory=set)  # nodes whose newest sign of life is an AgentAlive (it runs no ranks)
    idle_lost: set[str] = field(default_factory=set)  # ... declared lost, and not heard from since


STOPPING = "stopping"  # the setting that says so: "watched"
STRANDED = "stranded"  # "waits": a hang waits for a quiet node's fate
IDLE_LOST = "idle_lost_s"  # an idle agent silent this long is lost
INITIAL = State(sealed=True)


def snapshot(state: State) -> State:
    """A sealed copy of `state`: later folds of the original do not change it (nor it them)."""
    return State(jobs={job_id: job.clone() for job_id, job in state.jobs.items()}, ended=set(state.ended),
                 now=state.now, recovered_at=state.recovered_at, sealed=True, batches=dict(state.batches),
                 watch_stopping=state.watch_stopping, stranded_wait=state.stranded_wait,
                 idle_lost_s=state.idle_lost_s, idle=set(state.idle), idle_lost=set(state.idle_lost))



def job_watch(state: State, job_id: str, policy: PolicySpec | None = None) -> JobWatch | None:
    if job_id in state.ended:
        return None
    job = state.jobs.get(job_id)
    if job is None:
        policy = policy or PolicySpec()
        job = state.jobs[job_id] = JobWatch(job_id=job_id, policy=policy, spikes=SpikeWatch(policy.spike_window),
                                            diagnoses=Diagnoses(margin=policy.rollback_steps_back))
    return job


def new_attempt(job: JobWatch, attempt: int, ranks: Sequence[int]) -> None:
    job.attempt = attempt
    job.ranks = {r: RankWatch(r) for r in ranks}
    job.stopping = job.paused = False
    job.nonfinite.reset()
    job.stragglers = StragglerWatch()
    job.spikes.rewind()  # the loss curve goes on from the restore point: SpikeWatch drops what came after it
    job.diagnoses.restarted()
    job.recent.clear()


