"""What must hold after every seed, read from the recorded history (and from what the simulated ranks really did,
for the one question no record answers: did every step run?)."""

from collections import Counter
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.admission import admitted_events
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointFailed,
    FinalStateSaved,
    FinalStateUnsaved,
)
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss, SpikeDiagnosed
from flightdeck.events.history import HistoryGap, check_contiguous
from flightdeck.events.job import (
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPhaseChanged,
    JobResumed,
    JobSubmitted,
    RollbackAsked,
    WorkersStarted,
)
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.checkpoints.core import THROWN_AWAY
from flightdeck.services.shell.deadletter import given_up
from flightdeck.services.shell.fold import replay, same_decision
from flightdeck.services.shell.objects import segments
from flightdeck.services.tools.explore.world import NODES, Run
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.archived import stream_rows

# cores whose every decision a replay re-derives
VERIFIED = ("scheduler", "resources", "health", "checkpoints", "resharder", "archiver")


async def violations(run: Run) -> list[str]:
    out: list[str] = []
    control = run.store.rows(subjects.CONTROL)
    out += _completed_only_when_done(run, control)
    out += _every_job_ends(run, control)
    out += _decided_once(run, control)
    out += _no_rollback_without_a_finding(run, control)
    out += _one_diagnosis_per_spike(run, control)
    out += _poison_never_folded(run, control)
    out += _phases_as_recorded(run, control)
    out += _no_good_checkpoint_deleted(run, control)
    out += _completed_means_saved_or_said(run, control)
    out += _lineage_reported(run, control)
    out += await _history_whole(run, control)
    out += _waits_say_why(run, control)
    out += _lost_nodes_return(run, control)
    out += [m for shell in run.shells.values() for m in shell.snapshot_mismatches]
    for name in VERIFIED:
        out += await _replay_reproduces(run, name, control)
    return out


def _no_good_checkpoint_deleted(run: Run, control: list[Stored]) -> list[str]:
    """The simulated store keeps every committed set intact, so nothing may be deleted as bad (one node that cannot
    read the store is no evidence: issue 51), and retention never deletes a job's newest: some committed one of at
    least its step is still there."""
    out = []
    for job_id in run.job_ids:
        live: dict[str, int] = {}
        for e in _job_events(control, job_id):
            if isinstance(e, CheckpointCommitted):
                live[e.checkpoint_id] = e.step
            elif isinstance(e, CheckpointDeleted) and e.checkpoint_id in live:
                step = live.pop(e.checkpoint_id)
                if e.reason not in ("retention", THROWN_AWAY):
                    out.append(f"{job_id}: intact checkpoint {e.checkpoint_id} deleted as {e.reason!r}")
                elif e.reason == "retention" and not any(s >= step for s in live.values()):
                    out.append(f"{job_id}: retention deleted {e.checkpoint_id} (step {step}), its newest")
    return out


def _completed_means_saved_or_said(run: Run, control: list[Stored]) -> list[str]:
    """A completed job whose final set failed says its final state is unsaved, and one whose final state was saved
    never says otherwise (issue 51: a full store let a job end "completed" with its state from step 50)."""
    out = []
    for job_id in run.job_ids:
        events = _job_events(control, job_id)
        done = next((e for e in events if isinstance(e, JobCompleted)), None)
        if done is None:
            continue
        saved = any(isinstance(e, CheckpointCommitted) and e.step == done.steps for e in events)
        last = max((e.attempt for e in events if isinstance(e, WorkersStarted)), default=0)  # the one that completed
        final = f"step{done.steps:09d}-a{last}"  # its final set's id, whatever its timeline
        failed = any(isinstance(e, CheckpointFailed) and e.checkpoint_id.split("-t")[0] == final for e in events)
        said = [e for e in events if isinstance(e, FinalStateUnsaved)]
        amended = [e for e in events if isinstance(e, FinalStateSaved)]  # a final set that committed late
        if failed and not saved and not said:
            out.append(f"{job_id} completed, its final checkpoint failed, and nothing says its final state is unsaved")
        if saved and said and not amended:
            out.append(f"{job_id}: its final state was saved, yet FinalStateUnsaved says {said[0].reason!r}")
        if amended and not (saved and said):
            out.append(f"{job_id}: FinalStateSaved recorded, but its final state was not said unsaved and then saved")
        if len(said) > 1:
            out.append(f"{job_id}: FinalStateUnsaved recorded {len(said)} times")
    return out


def _lineage_reported(run: Run, control: list[Stored]) -> list[str]:
    """Every step a completed job's final state holds has its report: followed back from the attempt that completed,
    through the checkpoint each attempt restored to the attempt that saved it, each attempt reported every step it
    handed on. A fenced node's late write breaks this: the frozen agent's ranks trained on unseen, and the set they
    left committed while their reports died with them (the nemesis, seed 1: steps 70-89; issue 51)."""
    out = []
    telemetry = run.store.rows(subjects.TELEMETRY)
    for job_id in run.job_ids:
        events = _job_events(control, job_id)
        done = next((e for e in events if isinstance(e, JobCompleted)), None)
        if done is None:
            continue
        reported: dict[int, set[int]] = {}
        for e in admitted_events([t for t in telemetry if t.subject.startswith(f"fd.tel.{job_id}.")]):
            if isinstance(e, StepCompleted):
                reported.setdefault(e.attempt, set()).add(e.step)
        resumed = {e.attempt: e for e in events if isinstance(e, JobResumed)}
        attempt = max((e.attempt for e in events if isinstance(e, WorkersStarted)), default=0)
        until, seen = done.steps, set()
        while attempt not in seen:
            seen.add(attempt)
            r = resumed.get(attempt)
            start = r.from_step if r is not None else 0
            gaps = sorted(set(range(start, until)) - reported.get(attempt, set()))
            if gaps:
                out.append(f"{job_id}: its final state holds steps {gaps[0]}-{gaps[-1]} of attempt {attempt} "
                           f"({len(gaps)} steps), which no report records")
            if r is None or not r.checkpoint_id:
                break
            attempt, until = int(r.checkpoint_id.split("-a")[1].split("-")[0]), r.from_step
    return out


async def _history_whole(run: Run, control: list[Stored]) -> list[str]:
    """An ended job's telemetry as its history's own reader gives it back (archived segments, then the stream, which
    may have aged out) holds every message the job really had, or names a gap where they are; and the final
    segment's "nothing comes later" holds. The truth is the simulated stream as written, ages out notwithstanding."""
    out = []
    truth = run.store.rows(subjects.TELEMETRY)
    for job_id in run.job_ids:
        events = _job_events(control, job_id)
        submitted = next((e for e in events if isinstance(e, JobSubmitted)), None)
        records = [e for e in events if isinstance(e, HistoryArchived) and e.stream == subjects.TELEMETRY]
        if submitted is None or not any(r.final for r in records):
            continue
        rows, gaps = await stream_rows(run.aged or run.store, run.objects, job_id, subjects.TELEMETRY, records,
                                       submitted.occurred_at)
        got = {r.seq for r in rows}
        pattern = (segments.job_filter(job_id, subjects.TELEMETRY),)
        mine = [s.seq for s in truth if subjects.matches_any(pattern, s.subject)]
        final = max(r.last_seq for r in records if r.final)
        late = [seq for seq in mine if seq > final]
        lost = [seq for seq in mine if seq <= final and seq not in got
                and not any((g.from_seq or 1) <= seq <= g.to_seq for g in gaps)]
        if late:
            out.append(f"{job_id}: {len(late)} telemetry messages came after its final segment (through {final}), "
                       f"first at {late[0]}: its history drops them")
        if lost:
            out.append(f"{job_id}: {len(lost)} telemetry messages missing from its history with no gap said, "
                       f"first at {lost[0]}")
    return out


WAIT_BOUND_S = 10.0  # a job may wait this long in a phase short of running before its record must say why


def _waits_say_why(run: Run, control: list[Stored]) -> list[str]:
    """A job that waits (queued, placing, recovering, paused, stopping) longer than WAIT_BOUND_S has the reason in
    its phase record: issue 51's job sat in `recovering` with no free slot for 10 minutes, saying nothing."""
    out = []
    for job_id in run.job_ids:
        phases = [(e.occurred_at, e) for e in _job_events(control, job_id) if isinstance(e, JobPhaseChanged)]
        for (at, e), (until, _) in zip(phases, [*phases[1:], (run.plan.bound_s + phases[0][0], None)], strict=False):
            if e.phase not in ("running", "completed", "failed", "cancelled") and not e.reason \
                    and until - at > WAIT_BOUND_S:
                out.append(f"{job_id} waited {until - at:.0f}s in {e.phase} (attempt {e.attempt}) with no reason")
    return out


def _lost_nodes_return(run: Run, control: list[Stored]) -> list[str]:
    """A node declared lost whose agent still runs (frozen and resumed, or idle and slow) has registered again since
    (issue 51: an agent frozen 20 s left its node lost for ever). Nodes whose agent vanished, or is frozen as the run
    ends, are not asked to."""
    out = []
    for node in NODES:
        if node in run.ranks.nodes_down or node in run.ranks.frozen or not run.shells[f"agent-{node}"].up:
            continue
        lost = [s.seq for s in control if s.subject == subjects.node(node, "NodeLost")]
        back = [s.seq for s in control if s.subject == subjects.node(node, "NodeRegistered")]
        if lost and not any(seq > lost[-1] for seq in back):
            out.append(f"{node} was declared lost and its agent runs on, but it never registered again")
    return out


def _job_events(control: list[Stored], job_id: str) -> list[Any]:
    return admitted_events([s for s in control if s.subject.startswith(f"fd.ctl.job.{job_id}.")])


def _completed_only_when_done(run: Run, control: list[Stored]) -> list[str]:
    out = []
    for job_id in run.job_ids:
        if any(isinstance(e, JobCompleted) for e in _job_events(control, job_id)):
            if not any(a.finished for (j, _), a in run.ranks.attempts.items() if j == job_id):
                steps = max((a.step for (j, _), a in run.ranks.attempts.items() if j == job_id), default=0)
                out.append(f"{job_id} completed, but no attempt ran every step (furthest: step {steps})")
    return out


def _every_job_ends(run: Run, control: list[Stored]) -> list[str]:
    out = []
    for job_id in run.job_ids:
        ends = [e for e in _job_events(control, job_id) if isinstance(e, JobCompleted | JobFailed | JobCancelled)]
        if not ends:
            out.append(f"{job_id} never ended: {run.plan.bound_s - run.plan.faults_until:.0f}s after the last fault "
                       "it is still not completed, failed or cancelled")
        elif len(ends) > 1:
            out.append(f"{job_id} ended {len(ends)} times: {[type(e).__name__ for e in ends]}")
        elif isinstance(ends[0], JobFailed) and not ends[0].reason:
            out.append(f"{job_id} failed without a reason")
    return out


def _decided_once(run: Run, control: list[Stored]) -> list[str]:
    out = []
    ids = Counter(s.msg_id for s in control if s.msg_id)
    twice = [m for m, n in ids.items() if n > 1]
    if twice:
        out.append(f"{len(twice)} msg ids stored more than once, e.g. {twice[:3]}")
    for job_id in run.job_ids:
        try:
            check_contiguous(job_id, [s for s in control if s.subject.startswith(f"fd.ctl.job.{job_id}.")])
        except HistoryGap as exc:
            out.append(str(exc))
    return out


def _phases_as_recorded(run: Run, control: list[Stored]) -> list[str]:
    """The scheduler's phase records say what happened: "running" only once every granted rank of the attempt has
    started, nothing after the job's end, and the last record is that end; the job's view reads the same."""
    out = []
    ends: dict[type, str] = {JobCompleted: "completed", JobFailed: "failed", JobCancelled: "cancelled"}
    for job_id in run.job_ids:
        events = _job_events(control, job_id)
        view, ended = jobview.JobView(job_id=job_id), ""
        for event in events:
            before, view = view, jobview.evolve(view, event)
            if not isinstance(event, JobPhaseChanged):
                continue
            if ended:
                out.append(f"{job_id}: phase {event.phase} recorded after it {ended}")
            elif event.phase == "running" and not (before.granted and before.granted <= before.started):
                out.append(f"{job_id}: recorded running with ranks {sorted(before.granted - before.started)} of "
                           f"attempt {event.attempt} not started")
            ended = event.phase if event.phase in jobview.ENDED else ended
        end = next((ends[type(e)] for e in events if type(e) in ends), "")
        if end and view.phase != end:
            out.append(f"{job_id} {end}, but its recorded phase says {view.phase}")
    return out


def _no_rollback_without_a_finding(run: Run, control: list[Stored]) -> list[str]:
    triggers = {s.event.event_id for s in control
                if isinstance(s.event, LossSpikeDetected | NonFiniteLoss | RollbackAsked)}
    return [f"{e.job_id}: RollbackRequested {e.event_id} names no finding ({e.trigger_id!r})"
            for s in control if isinstance(e := s.event, RollbackRequested) and e.trigger_id not in triggers]


def _one_diagnosis_per_spike(run: Run, control: list[Stored]) -> list[str]:
    """Each verdict names a spike of its job, at most one per spike, and a hardware verdict names a node."""
    spikes = {s.event.event_id: s.event.job_id for s in control if isinstance(s.event, LossSpikeDetected)}
    verdicts = [e for s in control if isinstance(e := s.event, SpikeDiagnosed)]
    out = [f"{e.job_id}: SpikeDiagnosed {e.event_id} names no spike of the job ({e.finding_id!r})"
           for e in verdicts if spikes.get(e.finding_id) != e.job_id]
    twice = [f for f, n in Counter(e.finding_id for e in verdicts).items() if n > 1]
    out += [f"spike {f} diagnosed more than once" for f in twice]
    return out + [f"{e.job_id}: hardware verdict {e.event_id} names no node" for e in verdicts
                  if e.verdict == "hardware" and not e.suspect_nodes]


def _poison_never_folded(run: Run, control: list[Stored]) -> list[str]:
    return [f"{s.event.producer} acted on forged event {s.event.causation_id} ({type(s.event).__name__})"
            for s in control if s.event is not None and s.event.causation_id in run.poison_ids]


async def _replay_reproduces(run: Run, name: str, control: list[Stored]) -> list[str]:
    """A fresh replay of the recorded inputs decides exactly what was recorded (what `flightdeck verify` checks),
    effects' recorded outcomes aside."""
    shell = run.shells[name]
    recorded = {s.msg_id: s for s in control if s.msg_id.startswith(f"{name}:FD_")}
    out = []
    skip = await given_up(run.store, name)
    decided: dict[str, int] = {}  # input's msg-id prefix -> how many outputs the replay decided for it
    async for step in replay(shell.build(), run.store, skip=skip):
        decided[f"{name}:{step.input.stream}:{step.input.seq}"] = len(step.outputs)
        for o in step.outputs:
            rec = recorded.pop(o.msg_id, None)
            if rec is None:
                out.append(f"{name}: the replay decides {type(o.event).__name__} {o.msg_id}; the history lacks it")
            elif rec.subject != o.subject or not same_decision(rec, o.event):
                out.append(f"{name}: {o.msg_id} replays differently from what was recorded")
    for mid, s in recorded.items():
        prefix, _, index = mid.rpartition(":")
        if prefix in decided and int(index) >= decided[prefix]:
            continue  # an effect's outcome, numbered after the input's decisions: live only
        out.append(f"{name}: recorded {type(s.event).__name__} {mid} is not re-derived by a replay")
    return out[:5]
