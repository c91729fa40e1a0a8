"""Bad input on every subject the services read, through a real nats-server into the real shell: each bad
message becomes a DeadLettered with a reason (per service that reads it), no service stops, none of them
decides anything because of it, and afterwards they still answer good inputs, on the very job the junk
was published into."""

import asyncio
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flightdeck.events import codec, subjects
from flightdeck.events.catalog import BY_NAME
from flightdeck.events.clock import DeadLettered
from flightdeck.events.history import append_to_job, read_job
from flightdeck.events.job import CancelRequested, JobCancelled, JobQueued, JobSubmitted
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.fold import mismatch
from tests.badinput import hostile
from tests.badinput.platform import SPEC, Platform, platform
from tests.conftest import ensure_streams_at
from tests.integration.runtime_helpers import eventually, read_all

JOB = "JOBX"  # replaced by the platform's job id when publishing
CONTROL = 60  # bad messages on job control subjects
FLEET = 30  # ... on node subjects
TELEMETRY = 40  # ... on telemetry subjects


def _filters() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    from tests.badinput.cores import services
    return {n: ((*s.control_subjects,), (*s.telemetry_subjects,)) for n, s in ((n, f()) for n, f in services().items())}


FILTERS = _filters()
JOB_TYPES = sorted({p.split(".")[-1] for c, _ in FILTERS.values() for p in c if p.startswith("fd.ctl.job.")})
NODE_TYPES = sorted({p.split(".")[-1] for c, _ in FILTERS.values() for p in c if p.startswith("fd.ctl.node.")})
TEL_TYPES = sorted({p.split(".")[-1] for _, t in FILTERS.values() for p in t})


def _bad(subject: str, data: bytes) -> bool:
    try:
        event = codec.admit(data)
    except codec.UndecodableEvent:
        return True
    return bool(mismatch(subject.replace(JOB, "j-1"), event))


@st.composite
def payload(draw: st.DrawFn, type_name: str) -> bytes:
    cls = BY_NAME[type_name]
    other = draw(st.sampled_from(sorted(BY_NAME)))
    return draw(st.one_of(
        hostile.wire(cls), hostile.future(cls), hostile.events(cls).map(codec.encode),
        hostile.sane(BY_NAME[other]).map(codec.encode),  # a valid event under the wrong subject
        st.just(msgspec.msgpack.encode({"type": type_name, "job_id": "x" * 900_000})),  # near max_payload
    ))


@st.composite
def message(draw: st.DrawFn, family: str) -> tuple[str, bytes]:
    if family == "job":
        t = draw(st.sampled_from(JOB_TYPES))
        subject = f"fd.ctl.job.{JOB}.{t}"
    elif family == "node":
        t = draw(st.sampled_from(NODE_TYPES))
        subject = f"fd.ctl.node.n0.{t}"
    else:
        t = draw(st.sampled_from(TEL_TYPES))
        subject = f"fd.tel.{JOB}.{draw(st.sampled_from(['0', '1']))}.{t}"
    data = draw(payload(t).filter(lambda d: _bad(subject, d)))
    return subject, data


def collect(strategy: st.SearchStrategy[tuple[str, bytes]], n: int) -> list[tuple[str, bytes]]:
    """`n` examples as hypothesis explores them (one example of a list would start from the simplest: n copies
    of one message), drawn without a broker; the broker run then takes them all at once."""
    out: list[tuple[str, bytes]] = []

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(m: tuple[str, bytes]) -> None:
        out.append(m)

    draw()
    return out[:n]


@pytest.mark.timeout(150)
def test_bad_input_on_every_subject_is_dead_lettered_and_the_services_go_on(
        nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    bad = [*collect(message("job"), CONTROL), *collect(message("node"), FLEET), *collect(message("tel"), TELEMETRY)]
    assert len({m for m in bad}) > len(bad) // 2, "the messages are varied"
    ensure_streams_at(nats_server.url)
    asyncio.run(_scenario(nats_server.url, tmp_path, bad))


async def _scenario(url: str, tmp: Path, bad: list[tuple[str, bytes]]) -> None:
    async with platform(tmp, url) as p:
        await p.settled()
        before = [s for s in await p.control()]
        published: dict[tuple[str, int], str] = {}
        for subject, data in bad:
            ack = await p.store.js.publish(subject.replace(JOB, p.job), data)
            published[(ack.stream, ack.seq)] = subject.replace(JOB, p.job)
        await p.settled()
        expected = _expected_letters(published)
        await eventually(lambda: _lettered(p, expected), 40, "a dead letter for every bad message")
        reasons = {d.reason.split(":")[0] for d in await _letters(p)}
        print(f"\n{len(published)} bad messages -> {len(expected)} dead letters; kinds of reason: {sorted(reasons)}")
        assert not p.alive(), p.alive()
        # nothing any service decided was caused by a bad message
        for stored in await p.control():
            mid = stored.msg_id.split(":")
            if len(mid) == 4 and mid[0] in FILTERS:
                assert (mid[1], int(mid[2])) not in published, f"{stored.subject} answers a bad message"
        # ... and the good inputs still get their answers, on the job the junk went into too
        await append_to_job(p.store, CancelRequested(job_id=p.job, reason="done", event_id=f"cancel-{p.job}",
                                                     occurred_at=10.0, producer="cli"))
        fresh = f"{p.job}-ok"
        await append_to_job(p.store, JobSubmitted(job_id=fresh, spec=SPEC, event_id=f"sub-{fresh}", occurred_at=11.0,
                                                  producer="cli"))
        await eventually(lambda: _has(p, p.job, JobCancelled), 20, "the cancelled job's JobCancelled")
        await eventually(lambda: _has(p, fresh, JobQueued), 20, "the new job's JobQueued")
        await p.settled()
        assert not p.alive(), p.alive()
        history = await read_job(p.store, p.job)  # versions still contiguous past the junk
        assert [type(s.event).__name__ for s in history if s.event is not None][:1] == ["JobSubmitted"]
        before_ids = {(s.stream, s.seq) for s in before}
        assert before_ids <= {(s.stream, s.seq) for s in await p.control()}  # nothing stored was lost


def _expected_letters(published: dict[tuple[str, int], str]) -> set[tuple[str, str, int]]:
    """(service, stream, seq) for each bad message and each service that reads its subject (telemetry:
    only the services that tick while a job runs; the scheduler folds telemetry only during a rollback)."""
    out: set[tuple[str, str, int]] = set()
    for (stream, seq), subject in published.items():
        for name, (control, telemetry) in FILTERS.items():
            pats = control if stream == subjects.CONTROL else (telemetry if name in ("health", "checkpoints") else ())
            if any(subjects.matches(f, subject) for f in pats):
                out.add((_service_name(name), stream, seq))
    return out


def _service_name(name: str) -> str:
    return "agent-n0" if name == "agent" else name


async def _letters(p: Platform) -> list[DeadLettered]:
    return [s.event for s in await read_all(p.store, subjects.DEAD) if isinstance(s.event, DeadLettered)]


async def _lettered(p: Platform, expected: set[tuple[str, str, int]]) -> bool:
    seen = {(d.service, d.stream, d.seq) for d in await _letters(p) if d.reason}
    return expected <= seen


async def _has(p: Platform, job: str, kind: type) -> bool:
    return await p.store.last(subjects.CONTROL, subjects.job(job, kind.__name__)) is not None
