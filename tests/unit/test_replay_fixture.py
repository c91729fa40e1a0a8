"""Replaying the recorded spike drill (tests/fixtures/histories/spike.fdh.jsonl) through the history library
reproduces the live state at every sequence:

- each service core: the state folded from scratch up to control sequence S equals the state the one
  incremental (live-like) fold held after S, and the outputs decided from inputs up to S are exactly the
  decisions the live service recorded for those inputs (their msg ids name the input's sequence);
- the job view: `replay --until S` (from scratch) equals the view folded event by event up to S.
"""

import copy
import dataclasses
import math
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.training import FaultInjected, StepCompleted
from flightdeck.services.core import Service
from flightdeck.services.health.core import core_service as health
from flightdeck.services.health.core import snapshot as health_snapshot
from flightdeck.services.resharder.core import core_service as resharder
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.shell.fold import Folder, rebuild, replay, same_decision
from flightdeck.services.tools.console.replay_cmd import replayed, text
from flightdeck.services.tools.history import History, jobview, library
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.history.timeline import job_view_at
from flightdeck.services.tools.history.until import BadUntil, Cut, parse_until, resolve, submitted_at, tick_position

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "spike.fdh.jsonl"
JOB = "spike-000001"


@pytest.fixture(scope="module")
def history() -> History:
    return library.file_history(FIXTURE)


def frozen(state: Any) -> Any:
    """A value that later folds cannot change and that compares by content (health's state is mutable for speed,
    and some of its watches are slotted classes without __eq__)."""
    if type(state).__module__ == "flightdeck.services.health.state":
        return plain(health_snapshot(state))
    return copy.copy(state)


def plain(value: Any) -> Any:
    """`value` as builtins, walking dataclasses, slotted and plain objects; for comparing by content."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | deque):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((plain(v) for v in value), key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    slots = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())]
    if slots:
        return {type(value).__name__: {name: plain(getattr(value, name)) for name in slots if hasattr(value, name)}}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {type(value).__name__: plain(vars(value))}
    return value


def input_seq(msg_id: str) -> int:
    """`service:FD_CONTROL:<seq>:<i>` -> seq: the control input a decision answered."""
    _, stream, seq, _ = msg_id.split(":")
    assert stream in (subjects.CONTROL, subjects.TELEMETRY)
    return int(seq)


@pytest.mark.parametrize("build", [scheduler, health, resources, resharder], ids=lambda b: b.__module__.split(".")[2])
async def test_every_control_sequence_folds_to_the_live_state_and_its_recorded_decisions(
        history: History, build: Any) -> None:
    service: Service[Any] = build()
    stored = {s.msg_id: s for s in history.stream(subjects.CONTROL)
              if s.event is not None and s.event.producer == service.name
              and not isinstance(s.event, ClockTick | CoreConfigured)}
    recorded = {mid: s.event for mid, s in stored.items()}
    assert recorded, f"{service.name} recorded nothing"
    # One incremental fold, as the live service ran: the state after each control input it read.
    live = Folder(service)
    states: dict[int, Any] = {}
    decided: dict[int, dict[str, Any]] = {}  # control seq -> the outputs decided up to it
    so_far: dict[str, Any] = {}
    async for step in replay(service, history.store, folder=live):
        so_far.update({out.msg_id: out.event for out in step.outputs})
        if step.input.stream == subjects.CONTROL:
            states[step.input.seq] = frozen(live.state)
            decided[step.input.seq] = dict(so_far)
    assert set(so_far) == set(recorded)
    for seq in [s.seq for s in history.stream(subjects.CONTROL)]:
        if seq not in states:
            continue  # not one of this service's inputs: its state did not change there
        again = await rebuild(service, history.store, until=seq)
        assert frozen(again.state) == states[seq], f"{service.name}: state after FD_CONTROL {seq}"
        # Telemetry decisions are named by their telemetry seq; whether they are due by `seq` is the tick's say.
        due = {mid for mid in recorded
               if (mid.split(":")[1] == subjects.CONTROL and input_seq(mid) <= seq)
               or (mid.split(":")[1] == subjects.TELEMETRY and input_seq(mid) <= again.telemetry_seq)}
        assert set(decided[seq]) == due, f"{service.name}: decisions up to FD_CONTROL {seq}"
        for mid in due:
            assert same_decision(stored[mid], decided[seq][mid]), mid  # over the fields it was recorded with


def test_replay_until_each_sequence_equals_the_view_folded_event_by_event(history: History) -> None:
    view = JobView(job_id=JOB)
    job_rows = {s.seq: s for s in history.job_control()}
    for s in history.stream(subjects.CONTROL):
        if s.seq in job_rows and s.event is not None:
            view = jobview.evolve(view, s.event)
        result = replayed(history, str(s.seq))
        assert result.control_seq == s.seq
        expected = jobview.with_step(view, _newest_step_by_ticks(history, s.seq))
        assert result.state == expected, f"FD_CONTROL {s.seq}"
    assert view.phase == "completed" and view.rollbacks == 1 and view.restarts == 0


def _newest_step_by_ticks(history: History, seq: int) -> Any:
    position = tick_position(history.stream(subjects.CONTROL), seq)
    steps = [s.event for s in history.stream(subjects.TELEMETRY)
             if s.seq <= position and type(s.event).__name__ == "StepCompleted"]
    return steps[-1] if steps else None


def test_the_whole_replay_tells_the_spike_story_in_order(history: History) -> None:
    result = replayed(history, None)
    assert result.state.phase == "completed" and result.state.steps_done == 60 and result.at is None
    kinds = [(e.kind, e.type) for e in result.timeline]
    order = [("fault", "FaultInjected"), ("finding", "LossSpikeDetected"), ("rollback", "RollbackRequested"),
             ("rollback", "RolledBack"), ("end", "JobCompleted")]
    positions = [kinds.index(k) for k in order]
    assert positions == sorted(positions), kinds
    assert ("phase", "Phase") in kinds and ("checkpoint", "CheckpointCommitted") in kinds
    assert kinds.count(("rollback", "RolledBack")) == 1  # both ranks reported it: one line
    offsets = [e.offset_s for e in result.timeline]
    # in stream order; a decision carries its input's time, so a finding folded at a later tick of its service can
    # list after events stored before it with later times (here the spike, after a checkpoint of that second)
    assert offsets[0] == 0.0 and all(o >= 0 for o in offsets)
    spike = kinds.index(("finding", "LossSpikeDetected"))
    assert offsets[spike] == offsets[spike + 1]  # the rollback decided on it carries the same time
    printed = text(result)
    assert "LossSpikeDetected" in printed and "running -> completed" in printed


def test_until_a_time_after_submission_cuts_both_streams_by_time(history: History) -> None:
    base = submitted_at(history)
    # a whole second after submission between rank 0's first step and the drill's spike, read off the recording
    telemetry = [s.event for s in history.stream(subjects.TELEMETRY)]
    first_step = min(e.occurred_at for e in telemetry if isinstance(e, StepCompleted) and e.rank == 0)
    (spike,) = [e.occurred_at for e in telemetry if isinstance(e, FaultInjected) and e.kind == "loss_spike"]
    after_s = math.ceil(first_step - base)
    assert base + after_s < spike, "the recording leaves no whole second between its first step and its spike"
    cut = resolve(history, parse_until(f"{after_s}s"))
    assert cut.at == pytest.approx(base + after_s)
    for name, upto in ((subjects.CONTROL, cut.control_seq), (subjects.TELEMETRY, cut.telemetry_seq)):
        rows = history.stream(name)
        kept = [s for s in rows if s.seq <= upto]
        assert kept and len(kept) < len(rows)
        first_after = rows[len(kept)].event
        assert first_after is not None and cut.at is not None and first_after.occurred_at > cut.at
    state = job_view_at(history, cut)
    assert state.phase == "running" and state.rollbacks == 0 and state.step is not None
    iso = msgspec.json.decode(msgspec.json.encode(replayed(history, f"{after_s}s")))["at"]
    assert iso == pytest.approx(cut.at)


@pytest.mark.parametrize(("text_", "seq", "after", "at"), [
    ("57", 57, None, None), ("90s", None, 90.0, None), ("1m30s", None, 90.0, None), ("1.5h", None, 5400.0, None),
    ("1970-01-01T00:01:00Z", None, None, 60.0), ("1970-01-01T00:01:00", None, None, 60.0),
])
def test_until_accepts_sequences_durations_and_timestamps(text_: str, seq: int | None, after: float | None,
                                                         at: float | None) -> None:
    until = parse_until(text_)
    assert (until.seq, until.after_s, until.at) == (seq, after, at)


@pytest.mark.parametrize("bad", ["soon", "", "-5", "12x", "2026-13-45"])
def test_a_bad_until_says_what_it_accepts(bad: str) -> None:
    with pytest.raises(BadUntil, match="stream sequence"):
        parse_until(bad)


def test_a_cut_past_the_end_is_the_end(history: History) -> None:
    last = history.stream(subjects.CONTROL)[-1].seq
    assert resolve(history, parse_until("999999")).control_seq == last
    assert isinstance(resolve(history, None), Cut)
