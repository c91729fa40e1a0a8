"""Job histories: every event on `fd.ctl.job.<job>.*` carries its contiguous position, `job_version`.

Appends are fenced on the job's versioned events (`fd.ctl.job.<job>.*`), so two writers can never give two
events the same version; a writer that loses the race re-reads and tries again. A replay checks that versions
run 1, 2, 3, ... : a quietly truncated store file shows up as a gap instead of a shorter history.

A node agent's records of its ranks (`subjects.NODE_RECORDS`) are the exception: they go under
`fd.ctl.job.<job>.node.<node>.<type>`, unfenced and unnumbered (de-duplicated on their msg id), so a restart's
hundreds of node records do not queue behind one fence. Readers of the history (`fd.ctl.job.<job>.>`) get
them in stream order among the rest.
"""

import msgspec
import structlog

from flightdeck.events import codec, subjects
from flightdeck.events.admission import Admission
from flightdeck.events.base import JobEvent
from flightdeck.events.codec import type_name
from flightdeck.events.store import AppendResult, ConcurrencyConflict, EventStore, Stored

log = structlog.get_logger(__name__)

MAX_ATTEMPTS = 1000  # a conflict means another writer made progress, so this bounds a livelock, not slowness


class HistoryGap(Exception):
    """A job history whose versions are not contiguous: messages were lost or the history was forged."""

    def __init__(self, job_id: str, expected: int, found: int, seq: int) -> None:
        super().__init__(
            f"job {job_id}: expected job_version {expected} at stream sequence {seq}, found {found}; "
            "the history is missing events (a lost or truncated store file?) and cannot be replayed as is"
        )
        self.job_id, self.expected, self.found, self.seq = job_id, expected, found, seq


class _Versioned(msgspec.Struct):
    """Just the version of a stored job event, readable even when the full event is not (e.g. newer schema)."""

    job_version: int = 0


_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def version_of(stored: Stored) -> int:
    """The job_version of a stored job event; 0 when even that cannot be read."""
    if isinstance(stored.event, JobEvent):
        return stored.event.job_version
    try:
        return _version_decoder.decode(stored.data).job_version
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0


async def append_to_job(store: EventStore, event: JobEvent, msg_id: str = "") -> AppendResult:
    """Append `event` as the next version of its job's history; de-duplicated on `msg_id` (default: event id).

    A retry of an append that already landed returns that append with `duplicate=True`: recognised by
    the msg id of the job's last message, or (when others appended since) by the store's de-duplication.
    """
    msg_id = msg_id or event.event_id
    node = getattr(event, "node", "")
    if type_name(event) in subjects.NODE_RECORDS and node:
        return await store.append(subjects.job_node(event.job_id, node, type_name(event)),
                                  msgspec.structs.replace(event, job_version=0), msg_id=msg_id)
    fence = subjects.job_versioned(event.job_id)
    subject = subjects.job(event.job_id, type_name(event))
    bound = log.bind(job_id=event.job_id, type=type_name(event), msg_id=msg_id)
    conflict: ConcurrencyConflict | None = None
    for attempt in range(1, MAX_ATTEMPTS + 1):
        last = await store.last(subjects.CONTROL, fence)
        if last is not None and msg_id and last.msg_id == msg_id:
            return AppendResult(last.stream, last.seq, True)
        version = version_of(last) + 1 if last is not None else 1
        if last is not None and (last.event is None or junk(last)):
            # Forged or unreadable bytes are no place to number from (an unnumbered one would restart the
            # history at 1): number on from the newest event every reader admits.
            version = await _newest_version(store, event.job_id) + 1
        try:
            return await store.append(subject, msgspec.structs.replace(event, job_version=version), msg_id=msg_id,
                                      expected_last_seq=last.seq if last is not None else 0, fence=fence)
        except ConcurrencyConflict as exc:
            conflict = exc
            bound.debug("job history moved, retrying", attempt=attempt, expected=exc.expected, actual=exc.actual)
    assert conflict is not None
    raise conflict


def junk(stored: Stored) -> bool:
    """Bytes on a job's subjects that no reader folds: no event (and no version a newer writer put there), or
    an event that does not belong under its subject. Every reader dead-letters them, and they take no place
    in the history: appends number on past them, and contiguity passes them over."""
    if stored.event is None:
        return not _from_newer_code(stored.data) or version_of(stored) < 1
    return bool(Admission().refusal(stored))  # alone, with nothing admitted before it: its subject and version


def node_record(stored: Stored) -> bool:
    """A node agent's unversioned record, under its node's subject (subjects.job_node)."""
    ev = stored.event
    name = type_name(ev) if ev is not None else ""
    # compared as text, not built with subjects.job_node: a hostile node field must make junk, not raise
    return (name in subjects.NODE_RECORDS and isinstance(ev, JobEvent)
            and stored.subject == f"fd.ctl.job.{ev.job_id}.node.{getattr(ev, 'node', '')}.{name}")


def _from_newer_code(data: bytes) -> bool:
    try:
        codec.decode(data)
    except (codec.UnknownSchemaVersion, codec.UnknownEventType):
        return True
    except codec.UndecodableEvent:
        return False
    return False  # decodes, yet the store refused it: out of the bounds readers rely on


def _counts(stored: Stored, admission: Admission, expected: int) -> bool:
    """Whether `stored` is part of the history (what every reader admits), `expected` being the next version. A
    newer writer's event (undecodable here) counts when it comes in sequence; one off the sequence is forged."""
    if stored.event is None:
        return _from_newer_code(stored.data) and version_of(stored) == expected
    return not admission.refusal(stored) and not node_record(stored)


async def _newest_version(store: EventStore, job_id: str) -> int:
    newest, admission = 0, Admission()
    async for batch in store.read(subjects.CONTROL, [subjects.job_all(job_id)]):
        for stored in batch:
            if _counts(stored, admission, newest + 1):
                newest = version_of(stored)
    return newest


async def read_job(store: EventStore, job_id: str, *, check: bool = True) -> list[Stored]:
    """The job's control history in order; with `check`, raise HistoryGap unless versions run 1, 2, ..."""
    history: list[Stored] = []
    async for batch in store.read(subjects.CONTROL, [subjects.job_all(job_id)]):
        history.extend(batch)
    if check:
        check_contiguous(job_id, history)
    return history


def check_contiguous(job_id: str, history: list[Stored], first: int = 1) -> None:
    """Versions run first, first+1, ... over the history's admitted events (events/admission.py)."""
    expected, admission = first, Admission()
    for stored in history:
        if not _counts(stored, admission, expected):
            continue
        found = version_of(stored)
        if found != expected:
            raise HistoryGap(job_id, expected, found, stored.seq)
        expected += 1
