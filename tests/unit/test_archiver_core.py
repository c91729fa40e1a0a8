"""The archiver's core decides when each job's telemetry and output are archived: a segment of each stream every
`every_s` while the job runs, one at a time, picked up where the last record ended, and a final one once the job
has ended and settled; then it forgets the job."""

from flightdeck.events.archive import HistoryArchived
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.job import JobCompleted, JobSubmitted
from flightdeck.events.spec import JobSpec
from flightdeck.events.subjects import LOGS, TELEMETRY
from flightdeck.services.archiver.core import (
    ARCHIVE,
    FINAL_WAIT_S,
    SETTLE_S,
    Ask,
    State,
    core_service,
)
from flightdeck.services.core import Effect

SERVICE = core_service({ARCHIVE: lambda args: None}, every_s=60.0)  # type: ignore[dict-item]


def tick(now: float) -> ClockTick:
    return ClockTick(service="archiver", now=now, positions={}, event_id=f"t{now}", occurred_at=now)


def record(stream: str, first: int, last: int, final: bool = False) -> HistoryArchived:
    return HistoryArchived(job_id="j", stream=stream, first_seq=first, last_seq=last, count=1, bytes=1, sha256="s",
                           key=f"k{first}", final=final, occurred_at=0.0)


def fold(events: list[Event], state: State | None = None) -> tuple[State, list[Ask]]:
    state = state if state is not None else SERVICE.initial
    asks: list[Ask] = []
    for ev in events:
        state, outs = SERVICE.transition(state, ev)
        asks += [o.args for o in outs if isinstance(o, Effect) and o.kind == ARCHIVE]
    return state, asks


def submitted() -> State:
    return fold([JobSubmitted(job_id="j", spec=JobSpec(name="j"), event_id="s", occurred_at=100.0)])[0]


def test_a_running_job_is_archived_every_interval_from_where_its_last_segment_ended() -> None:
    state, asks = fold([tick(130.0)], submitted())
    assert asks == []  # not yet: every_s after the submission
    state, asks = fold([tick(160.0)], state)
    assert [(a.stream, a.from_seq, a.final) for a in asks] == [(TELEMETRY, 0, False), (LOGS, 0, False)]
    assert all(a.submitted_at == 100.0 for a in asks)
    state, asks = fold([tick(170.0), record(TELEMETRY, 1, 500)], state)
    assert asks == []  # one at a time: the next after every_s
    state, asks = fold([tick(221.0)], state)
    assert [(a.stream, a.from_seq) for a in asks] == [(TELEMETRY, 501), (LOGS, 0)]  # LOGS: nothing new recorded


def test_an_ended_job_gets_its_final_segments_once_settled_then_is_forgotten() -> None:
    state, _ = fold([tick(160.0), record(TELEMETRY, 1, 500)], submitted())
    state, asks = fold([JobCompleted(job_id="j", steps=10, event_id="c", occurred_at=170.0), tick(171.0)], state)
    assert asks == []  # its last lines may still be on their way
    state, asks = fold([tick(170.0 + SETTLE_S)], state)
    assert [(a.stream, a.from_seq, a.final) for a in asks] == [(TELEMETRY, 501, True), (LOGS, 0, True)]
    state, asks = fold([record(TELEMETRY, 501, 900, final=True), tick(170.0 + SETTLE_S + 61)], state)
    assert asks == []  # its read may go on while the job's messages still come: not asked again meanwhile
    state, asks = fold([tick(170.0 + SETTLE_S + FINAL_WAIT_S)], state)
    assert [(a.stream, a.final) for a in asks] == [(LOGS, True)]  # its record never came: asked again
    state, _ = fold([record(LOGS, 1, 40, final=True)], state)
    assert state.jobs == {} and state.done == {"j"}
    _, asks = fold([JobSubmitted(job_id="j", spec=JobSpec(name="j"), event_id="s2", occurred_at=999.0),
                    tick(5000.0)], state)
    assert asks == []  # a resubmitted id (a replayed input) does not start it again


def test_the_same_inputs_decide_the_same_and_recorded_settings_are_folded_back() -> None:
    inputs: list[Event] = [tick(160.0), record(TELEMETRY, 1, 500), tick(230.0)]
    assert fold(inputs, submitted())[1] == fold(inputs, submitted())[1]
    slow = CoreConfigured(service="archiver", settings={"every_s": 600.0})
    state, asks = fold([slow, JobSubmitted(job_id="j", spec=JobSpec(name="j"), event_id="s", occurred_at=100.0),
                        tick(400.0)])
    assert state.settings.every_s == 600.0 and asks == []


def test_a_final_ask_is_repeated_only_after_its_read_must_have_ended_and_old_histories_replay_as_they_ran() -> None:
    """A final segment's read goes on until the job's messages stop (FINAL_READ_MAX_S at most): asked again every
    `every_s` (1 s in a drill) meanwhile, two reads overlapped and stored the same messages twice. Histories whose
    recorded settings predate it asked again after `every_s`, and replay so."""
    for settings, again in (({"every_s": 1.0, "final_wait_s": FINAL_WAIT_S}, FINAL_WAIT_S), ({"every_s": 1.0}, 1.0)):
        state, _ = fold([CoreConfigured(service="archiver", settings=settings),
                         JobSubmitted(job_id="j", spec=JobSpec(name="j"), event_id="s", occurred_at=100.0),
                         JobCompleted(job_id="j", steps=10, event_id="c", occurred_at=170.0)])
        state, asks = fold([tick(170.0 + SETTLE_S)], state)
        assert [a.final for a in asks] == [True, True]
        state, asks = fold([tick(170.0 + SETTLE_S + again - 0.5)], state)
        assert asks == [], settings
        _, asks = fold([tick(170.0 + SETTLE_S + again)], state)
        assert [a.final for a in asks] == [True, True], settings
