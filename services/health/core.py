"""The health monitor's core: job events and rank telemetry in, findings out (detectors.py holds the rules).

Why it works this way: docs/internals.md, "6. The health monitor".
"""

import math
from collections import deque

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.commands import PauseRequested, ResumeRequested, RollbackRequested, StopRequested
from flightdeck.events.findings import (
    Finding,
    InexactRestore,
    LossOutlier,
    LossSpikeDetected,
    NonFiniteLoss,
    RankHung,
    RankLost,
    SpikeDiagnosed,
    StragglerDetected,
    spike_onset,
)
from flightdeck.events.fleet import AgentAlive
from flightdeck.events.heartbeats import RankHeartbeats
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPreempted,
    JobSubmitted,
    WorkersExited,
    WorkersStarted,
    failed,
)
from flightdeck.events.training import Heartbeat, RankFault, RankStarted, RolledBack, SpikeReplayed, StepCompleted
from flightdeck.services.core import Emit, Output, Service
from flightdeck.services.health import agents
from flightdeck.services.health.detectors import EVIDENCE_MAX, Hung, Lost, RankWatch
from flightdeck.services.health.spikes import Outlier
from flightdeck.services.health.state import (
    IDLE_LOST,
    INITIAL,
    STOPPING,
    STRANDED,
    JobWatch,
    State,
    job_watch,
    new_attempt,
    snapshot,
)

NAME = "health"
CONTROL_TYPES = (
    "JobSubmitted", "AllocationGranted", "WorkersStarted", "WorkersExited", "AllocationReleased",
    "StopRequested", "JobPreempted", "CancelRequested", "PauseRequested", "ResumeRequested", "RollbackRequested",
    "JobCompleted", "JobFailed", "JobCancelled",
    "LossSpikeDetected",  # its own finding, read back with its id: a rollback names it, its diagnosis starts
)
TELEMETRY_TYPES = ("Heartbeat", "StepCompleted", "RankFault", "RankStarted", "RankHeartbeats", "SpikeReplayed",
                   "RolledBack")
MAX_FINDINGS_PER_TICK = 8  # lost/hung findings per job per tick
IDLE_LOST_S = 30.0  # an idle agent beats every agent IDLE_BEAT_S (5 s): six missed


def _emit(out: list[Output], finding: Finding) -> None:
    out.append(Emit(subjects.job(finding.job_id, type(finding).__name__), finding))


def _restart_clocks(job: JobWatch, ev: Event, now: float) -> None:
    for r in job.ranks.values():
        r.restart_clock(ev.occurred_at, now, ev.event_id)


def _control(state: State, ev: Event, out: list[Output]) -> None:
    match ev:
        case JobSubmitted():
            if ev.job_id not in state.jobs and (job := job_watch(state, ev.job_id, ev.spec.policy)) is not None:
                job.last_step = ev.spec.train.steps - 1
                # A spike within this many steps of another is the same incident to the scheduler (recipes.after_loss)
                job.diagnoses.margin = max(ev.spec.policy.rollback_steps_back, ev.spec.train.checkpoint_every)
        case AllocationGranted():
            job = job_watch(state, ev.job_id)
            if job is not None and ev.attempt > job.attempt:
                lost = {node for attempt, node in job.silent if attempt == job.attempt}  # concluded already
                job.unrecorded |= agents.left_behind(job.job_id, job.attempt,
                                                     [r for r in job.ranks.values() if r.node not in lost],
                                                     ev.occurred_at, state.now, ev.event_id)
                new_attempt(job, ev.attempt, sorted({ref.rank for ref in ev.assignments}))
                for ref in ev.assignments:
                    job.ranks[ref.rank].granted(ref.node, ev.occurred_at, state.now, ev.event_id)
        case WorkersStarted():
            job = job_watch(state, ev.job_id)
            if job is None or ev.attempt < job.attempt:
                return
            if ev.attempt > job.attempt:
                new_attempt(job, ev.attempt, ())
            for rank in ev.ranks:
                watch = job.ranks.get(rank)
                if watch is None:
                    watch = job.ranks[rank] = RankWatch(rank)
                watch.started(ev.occurred_at, state.now, ev.event_id)
                watch.node = ev.node
        case WorkersExited():
            _exited(state, ev, out)
        case StopRequested() | JobPreempted() | CancelRequested():
            job = state.jobs.get(ev.job_id)
            if job is not None:
                job.stopping = True
                job.cancelling = job.cancelling or isinstance(ev, CancelRequested)
        case AllocationReleased():
            job = state.jobs.get(ev.job_id)
            if job is not None and ev.attempt == job.attempt:
                job.stopping = True  # the agents kill what is left: silence and exits are expected now
                for r in job.ranks.values():
                    job.gone(r)
        case PauseRequested():
            if (job := state.jobs.get(ev.job_id)) is not None:
                job.paused = True
        case ResumeRequested():
            if (job := state.jobs.get(ev.job_id)) is not None and job.paused:
                job.paused = False
                _restart_clocks(job, ev, state.now)
        case RollbackRequested():
            if (job := state.jobs.get(ev.job_id)) is not None:
                _restart_clocks(job, ev, state.now)
                job.nonfinite.reset()  # a slow rank stays slow across a rollback: straggler runs go on
                job.diagnoses.rollback(ev)
        case LossSpikeDetected():
            if (job := state.jobs.get(ev.job_id)) is not None:
                onset = spike_onset(ev)
                window = {rank: {s: x for s, x in q if onset <= s <= ev.step} for rank, q in job.recent.items()}
                nodes = {rank: r.node for rank, r in job.ranks.items()}
                _diagnosed(out, job.diagnoses.spike(ev, nodes, window))
        case JobCompleted() | JobFailed() | JobCancelled():
            if (job := state.jobs.pop(ev.job_id, None)) is not None:
                _diagnosed(out, job.diagnoses.ended())
            state.ended.add(ev.job_id)


def _exited(state: State, ev: WorkersExited, out: list[Output]) -> None:
    job = state.jobs.get(ev.job_id)
    if job is None:
        return
    for x in ev.exits():
        if job.unrecorded.pop((ev.attempt, x.rank), None) is not None:
            job.recording[ev.node] = (ev.occurred_at, state.now)  # its agent is alive, working through the exits
        r = job.ranks.get(x.rank) if ev.attempt == job.attempt else None
        if r is None:
            continue
        r.exited = True
        if r.gone:
            continue
        job.gone(r)
        if not failed(x) or job.quiet or not job.first(r.rank, "RankLost"):
            continue
        evidence = list(dict.fromkeys(i for i in (ev.event_id, r.fault_id, r.seen_id) if i))
        how = " without calling flightdeck.init()" if x.unlinked and x.exit_code == 0 else ""
        _emit(out, RankLost(job_id=job.job_id, rank=r.rank, attempt=job.attempt, evidence=evidence,
                              reason=f"exited with code {x.exit_code}{how}", last_seen=r.seen_at or r.started_at))


def _diagnosed(out: list[Output], verdict: SpikeDiagnosed | None) -> None:
    if verdict is not None:
        _emit(out, verdict)


def _step(state: State, job: JobWatch, r: RankWatch, ev: StepCompleted, out: list[Output]) -> None:
    r.step_completed(ev.step, ev.step_time_s, ev.occurred_at, state.now, ev.event_id)
    recent = job.recent.get(r.rank)
    if recent is None:
        recent = job.recent[r.rank] = deque(maxlen=EVIDENCE_MAX)
    recent.append((ev.step, ev.loss))
    job.diagnoses.loss(r.rank, ev.step, ev.loss)
    if r.rank == 0:
        _diagnosed(out, job.diagnoses.stepped(ev.step))
    finite = math.isfinite(ev.loss) and (ev.grad_norm is None or math.isfinite(ev.grad_norm))
    if job.nonfinite.observe(ev.step, finite) and job.first(r.rank, "NonFiniteLoss", job.nonfinite.episodes):
        _emit(out, NonFiniteLoss(job_id=job.job_id, rank=r.rank, attempt=job.attempt, evidence=[ev.event_id],
                                   step=ev.step, loss=ev.loss, grad_norm=ev.grad_norm,
                                   schema_version=2 if ev.grad_norm is None else 1))
    policy = job.policy
    if r.rank == 0:
        spike = job.spikes.observe(ev.step, ev.loss, policy, ev.lr, ev.event_id)
        if isinstance(spike, Outlier):
            if job.first(0, "LossOutlier", spike.step):
                _emit(out, LossOutlier(job_id=job.job_id, rank=0, attempt=job.attempt, evidence=[spike.event_id],
                                       step=spike.step, loss=spike.loss, baseline=spike.baseline, z=spike.z,
                                       log=spike.log))
        elif spike is not None and job.first(0, "LossSpikeDetected", spike.episode):
            _emit(out, LossSpikeDetected(
                job_id=job.job_id, rank=0, attempt=job.attempt, evidence=list(spike.ids), step=spike.step,
                loss=spike.loss, baseline=spike.baseline, mad=spike.mad, z=spike.z, threshold=spike.threshold,
                onset=spike.onset, score=spike.score, losses=list(spike.losses), log=spike.log,
                schema_version=2))
    _straggler(job, r.rank, ev.step, ev.step_time_s, ev.event_id, out)


def _straggler(job: JobWatch, rank: int, step: int, step_time_s: float, event_id: str, out: list[Output]) -> None:
    slow = job.stragglers.observe(rank, step, step_time_s, event_id, job.policy)
    if slow is not None and job.first(slow.rank, "StragglerDetected", slow.episode):
        _emit(out, StragglerDetected(
            job_id=job.job_id, rank=slow.rank, attempt=job.attempt, evidence=list(slow.evidence),
            step_time_s=slow.step_time_s, peer_median_s=slow.peer_median_s, factor=slow.factor))


def _beats(state: State, ev: RankHeartbeats, out: list[Output]) -> None:
    """A node agent's batch: each entry is the rank's own heartbeat, and a step time is that step reported.
    Ranks that publish only through their agent have no StepCompleted but rank 0's, so a new step in a beat
    arms the hang clock and feeds the straggler watch as a StepCompleted would."""
    if ev.node and ev.occurred_at >= state.batches.get(ev.node, (0.0, 0.0))[0]:
        state.batches[ev.node] = (ev.occurred_at, state.now)
        state.idle.discard(ev.node)  # it runs ranks: their batches tell its silence, per job
        state.idle_lost.discard(ev.node)
    job = state.jobs.get(ev.job_id)
    if job is None:
        return
    if ev.attempt != job.attempt:
        if ev.attempt < job.attempt and job.unrecorded:
            for b in ev.beats:
                agents.heard(job.unrecorded, ev.attempt, b.rank, b.occurred_at, state.now, ev.event_id)
        return
    for b in ev.beats:
        r = job.ranks.get(b.rank)
        if r is None:
            continue
        if b.step_time_s > 0 and b.step > r.progress_step:
            r.step_completed(b.step, b.step_time_s, b.occurred_at, state.now, ev.event_id)
            _straggler(job, r.rank, b.step, b.step_time_s, ev.event_id, out)
        else:
            r.heartbeat(b.step, b.occurred_at, state.now, ev.event_id)


def _telemetry(state: State, ev: Heartbeat | StepCompleted | RankFault | RankStarted | SpikeReplayed | RolledBack,
               out: list[Output]) -> None:
    job = state.jobs.get(ev.job_id)
    if job is not None and ev.attempt < job.attempt and job.unrecorded:
        agents.heard(job.unrecorded, ev.attempt, ev.rank, ev.occurred_at, state.now, ev.event_id)
    if job is None or ev.attempt != job.attempt:
        return
    r = job.ranks.get(ev.rank)
    if r is None:
        return
    if type(ev) is Heartbeat:
        r.heartbeat(ev.step, ev.occurred_at, state.now, ev.event_id)
    elif isinstance(ev, StepCompleted):
        _step(state, job, r, ev, out)
    elif isinstance(ev, SpikeReplayed):
        r.seen(ev.occurred_at, state.now, ev.event_id)
        _diagnosed(out, job.diagnoses.replayed(ev))
    elif isinstance(ev, RolledBack):
        job.diagnoses.landed(ev)
    elif isinstance(ev, RankStarted):
        r.seen(ev.occurred_at, state.now, ev.event_id)
        r.progressed(ev.from_step - 1, ev.occurred_at, state.now, ev.event_id)
        if ev.exactness and job.first(-1, "InexactRestore"):  # the attempt's first rank to say so speaks for it
            _emit(out, InexactRestore(job_id=job.job_id, rank=r.rank, attempt=job.attempt, evidence=[ev.event_id],
                                      step=ev.from_step, reason=ev.exactness))
    elif isinstance(ev, RankFault):
        r.seen(ev.occurred_at, state.now, ev.event_id)
        r.fault_id = ev.event_id
        if ev.kind == "nonfinite" and job.nonfinite.observe(ev.step, False) and job.first(
                r.rank, "NonFiniteLoss", job.nonfinite.episodes):
            _emit(out, NonFiniteLoss(job_id=job.job_id, rank=r.rank, attempt=job.attempt, evidence=[ev.event_id],
                                       step=ev.step, loss=math.nan, grad_norm=math.nan))


def _worst_first(verdict: Lost | Hung) -> tuple[int, float, int]:
    if isinstance(verdict, Lost):
        return (0, verdict.last_seen, verdict.rank)
    return (1, -verdict.stalled_s, verdict.rank)


def _latest(starts: list[tuple[str, float, float]]) -> dict[str, tuple[float, float]]:
    """node -> the latest (occurred_at, folded) of `starts`."""
    out: dict[str, tuple[float, float]] = {}
    for node, at, folded in starts:
        was = out.get(node, (0.0, 0.0))
        out[node] = (max(was[0], at), max(was[1], folded))
    return out


def _alive(state: State, ev: AgentAlive) -> None:
    """An idle agent's sign of life: the node is watched for silence while its newest sign is one of these."""
    if state.idle_lost_s > 0 and ev.occurred_at >= state.batches.get(ev.node, (0.0, 0.0))[0]:
        state.batches[ev.node] = (ev.occurred_at, state.now)
        state.idle.add(ev.node)
        state.idle_lost.discard(ev.node)


def _tick(state: State, tick: ClockTick, out: list[Output]) -> None:
    state.now = now = max(state.now, tick.now)
    state.recovered_at = max(state.recovered_at, tick.recovered_at)
    lost_now: set[str] = set()
    if state.idle_lost_s > 0:  # an agent that dies idle: nothing else tells until a job waits on it (issue 51)
        for node in agents.idle_silent(state.batches, state.idle, state.idle_lost, state.idle_lost_s, now,
                                       state.recovered_at):
            state.idle_lost.add(node)
            lost_now.add(node)
            out.append(agents.idle_node(node, state.batches[node][0], state.idle_lost_s))
    for job in state.jobs.values():
        # A node whose agent fell silent is lost at the lost deadline: its ranks of this attempt, or of a replaced
        # one that it never recorded as exited, died with it. First, so the recovery never places ranks there.
        # node -> when it last had to be running ranks (their start): silence counts from then at the earliest.
        # Also while the attempt is being stopped: its agent batches until it records its ranks' exits, and the
        # restart may be waiting on the node's fate (the survivors' snapshots commit once it is known lost).
        running = [(r.node, r.started_at, r.started_folded) for r in job.ranks.values()
                   if r.node and r.started_id and not r.exited and (state.watch_stopping or not job.quiet)]
        suspects = _latest([*running, *((u.node, u.seen_at, u.seen_folded) for u in job.unrecorded.values())])
        for node in agents.silent(state.batches, suspects, job.policy, now, state.recovered_at):
            for key in [k for k, u in job.unrecorded.items() if u.node == node]:
                del job.unrecorded[key]  # concluded now: not again when its exit deadline passes
            if (job.attempt, node) not in job.silent:
                job.silent.add((job.attempt, node))
                if node not in lost_now:
                    lost_now.add(node)
                    out.append(agents.silent_node(node, job.job_id, state.batches[node][0], job.policy))
        # An agent that never acted on a grant (no start, no "could not start") died idle: nothing else tells, since
        # an agent batches heartbeats only while it runs ranks. Lost, so the recovery does not place ranks there.
        for node in sorted({r.granted_node for r in job.ranks.values() if r.never_started(job.policy, now)}):
            if (job.attempt, node) not in job.silent:
                job.silent.add((job.attempt, node))
                if node not in lost_now:
                    lost_now.add(node)
                    out.append(agents.never_started(node, job.job_id, job.policy))
        if job.unrecorded:
            alive = {r.node for r in job.ranks.values() if r.started_id}
            out.extend(agents.overdue(job.unrecorded, job.policy, now, alive, job.recording))
        if job.quiet:
            continue
        verdicts = [v for r in job.ranks.values()
                    if (v := r.judge(job.policy, now, job.paused, job.last_step, state.recovered_at)) is not None]
        # Ranks stalled while a node of their job has gone quiet are waiting on it in a collective: that node's loss
        # is the fault, told at the lost deadline; a hang told first would blame the wrong one. Judged once the node
        # is lost or heard from again, so a hang waits at most the lost deadline.
        if state.stranded_wait and any((job.attempt, node) not in job.silent for node in agents.overdue_batches(
                state.batches, _latest(running), job.policy, now, state.recovered_at)):
            verdicts = [v for v in verdicts if not isinstance(v, Hung)]
        if len(verdicts) > MAX_FINDINGS_PER_TICK:
            # A hung collective stalls every rank at once: report the worst few now. The first finding
            # usually stops the attempt; if not, the rest follow at the next ticks.
            verdicts = sorted(verdicts, key=_worst_first)[:MAX_FINDINGS_PER_TICK]
        for verdict in verdicts:
            r = job.ranks[verdict.rank]
            evidence = list(verdict.evidence)
            if isinstance(verdict, Lost):
                job.gone(r)
                if job.first(r.rank, "RankLost"):
                    _emit(out, RankLost(job_id=job.job_id, rank=r.rank, attempt=job.attempt, evidence=evidence,
                                          reason=verdict.reason, last_seen=verdict.last_seen,
                                          never_heard=verdict.never_heard,
                                          schema_version=2 if verdict.never_heard else 1))
            else:
                r.hung = True
                if job.first(r.rank, "RankHung"):
                    _emit(out, RankHung(job_id=job.job_id, rank=r.rank, attempt=job.attempt, evidence=evidence,
                                          step=verdict.step, stalled_s=verdict.stalled_s,
                                          deadline_s=verdict.deadline_s))


TELEMETRY = (Heartbeat, StepCompleted, RankFault, RankStarted, SpikeReplayed, RolledBack)


def transition(state: State, ev: Event) -> tuple[State, list[Output]]:
    if state.sealed:
        state = snapshot(state)
        state.sealed = False
    out: list[Output] = []
    if isinstance(ev, TELEMETRY):
        _telemetry(state, ev, out)
    elif isinstance(ev, RankHeartbeats):
        _beats(state, ev, out)
    elif isinstance(ev, AgentAlive):
        _alive(state, ev)
    elif isinstance(ev, ClockTick):  # the fold hands a service only its own ticks
        _tick(state, ev, out)
    elif isinstance(ev, CoreConfigured):
        if ev.service == NAME:
            state.watch_stopping = ev.settings.get(STOPPING) == "watched"
            state.stranded_wait = ev.settings.get(STRANDED) == "waits"
            state.idle_lost_s = float(ev.settings.get(IDLE_LOST) or 0.0)
    else:
        _control(state, ev, out)
    return state, out


def wants_tick(state: State, now: float) -> bool:
    """Telemetry is folded only at ticks, so tick while some job has ranks to watch, or agents that still owe
    the exits of ranks being stopped (their silence is a lost node)."""
    return any((not job.quiet and any(r.live or (r.grant_id and not r.gone) for r in job.ranks.values()))
               or bool(job.unrecorded) or _owing(state, job) for job in state.jobs.values()) or _idle_due(state, now)


def _idle_due(state: State, now: float) -> bool:
    """Idle agents are watched through ticks: the AgentAlive beats are telemetry, folded at ticks. Once a deadline
    since the last tick, and once an idle agent's silence as folded reaches it (a tick folds what it sent since, or
    finds it lost): an idle fleet ticks about once a deadline, not once a `tick_s`."""
    return state.idle_lost_s > 0 and (now - state.now >= state.idle_lost_s or bool(agents.idle_silent(
        state.batches, state.idle, state.idle_lost, state.idle_lost_s, now, state.recovered_at)))


def _owing(state: State, job: JobWatch) -> bool:
    """A started rank not recorded as exited on a node whose agent batches (so its silence would tell)."""
    return state.watch_stopping and any(r.node in state.batches and r.started_id and not r.exited
                                        and (job.attempt, r.node) not in job.silent for r in job.ranks.values())


def core_service(*, tick_s: float = 1.0, idle_lost_s: float = IDLE_LOST_S) -> Service[State]:
    return Service(
        name=NAME,
        initial=INITIAL,
        transition=transition,
        control_subjects=subjects.job_types(*CONTROL_TYPES),
        telemetry_subjects=(*(f"fd.tel.*.*.{t}" for t in TELEMETRY_TYPES), f"fd.tel.{subjects.FLEET}.*.AgentAlive"),
        tick_s=tick_s,
        wants_tick=wants_tick,
        copy=snapshot,
        # tick_s: when ticks are taken (what they decide comes from the recorded ticks)
        settings={"tick_s": tick_s, STOPPING: "watched", STRANDED: "waits", IDLE_LOST: idle_lost_s},
        unrecorded={"tick_s": tick_s, STOPPING: "unwatched", STRANDED: "judged", IDLE_LOST: 0.0},
    )
