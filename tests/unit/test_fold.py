"""The fold over the in-memory store: stamping, telemetry at ticks, refusals, and replay equal to live."""

import asyncio
from dataclasses import dataclass, replace

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.codec import encode
from flightdeck.events.commands import CheckpointRequested
from flightdeck.events.job import CancelRequested, JobQueued, JobSubmitted
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import MemoryStore, Stored, decoded
from flightdeck.events.training import StepCompleted
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell.fold import Folder, Step, comparable, outputs_of, rebuild, replay
from flightdeck.services.shell.tap import TelemetryTap
from tests.unit.helpers import append


@dataclass(frozen=True)
class Tally:
    submitted: int = 0
    steps: tuple[tuple[str, int, int], ...] = ()  # (job, rank, step) in the order folded
    ticks: int = 0


def evolve(state: Tally, ev: Event) -> Tally:
    match ev:
        case JobSubmitted():
            return replace(state, submitted=state.submitted + 1)
        case StepCompleted():
            return replace(state, steps=(*state.steps, (ev.job_id, ev.rank, ev.step)))
        case ClockTick():
            return replace(state, ticks=state.ticks + 1)
        case CancelRequested(reason="boom"):
            raise RuntimeError("boom requested")
    return state


def decide(state: Tally, ev: Event) -> list[Emit | Effect]:
    match ev:
        case JobSubmitted():
            out: list[Emit | Effect] = [Emit(subjects.job(ev.job_id, "JobQueued"),
                                             JobQueued(job_id=ev.job_id, priority=state.submitted))]
            if ev.spec.priority == 7:
                out.append(Effect("upload", ev.job_id))
            if ev.spec.priority == 8:
                out.append(Effect("teleport", ev.job_id))
            return out
        case StepCompleted():
            return [Emit(subjects.job(ev.job_id, "CheckpointRequested"),
                         CheckpointRequested(job_id=ev.job_id, reason=f"{ev.rank}:{ev.step}:{len(state.steps)}"))]
    return []


async def _no_io(args: object) -> list[Emit]:
    return []


def transition(state: Tally, ev: Event) -> tuple[Tally, list[Emit | Effect]]:
    after = evolve(state, ev)
    return after, decide(after, ev)


TOY = Service(name="toy", initial=Tally(), transition=transition,
              control_subjects=("fd.ctl.job.*.JobSubmitted", "fd.ctl.job.*.CancelRequested"),
              telemetry_subjects=("fd.tel.*.*.StepCompleted",), effects={"upload": _no_io})


def submitted(job: str, at: float = 100.0, priority: int = 50, event_id: str = "") -> JobSubmitted:
    return JobSubmitted(job_id=job, event_id=event_id or f"cli-{job}", occurred_at=at,
                        spec=JobSpec(name="toy", priority=priority))


def step(job: str, rank: int, n: int, nonce: int = 0) -> StepCompleted:
    return StepCompleted(job_id=job, rank=rank, step=n, loss=1.0, grad_norm=1.0, lr=0.1, tokens_per_s=1.0,
                         step_time_s=0.1, event_id=f"{job}-{rank}-{n}" + (f"-{nonce}" if nonce else ""))


async def put(store: MemoryStore, subject: str, event: Event) -> Stored:
    res = await append(store, subject, event)
    return await _at(store, res.stream, res.seq)


async def _at(store: MemoryStore, stream: str, seq: int) -> Stored:
    async for batch in store.read(stream, from_seq=seq, until_seq=seq):
        return batch[0]
    raise AssertionError(f"no {stream} message {seq}")


def tick(now: float, telemetry_pos: int) -> ClockTick:
    return ClockTick(service="toy", now=now, positions={subjects.TELEMETRY: telemetry_pos},
                     event_id=f"toy-tick-{now}", occurred_at=now)


async def test_outputs_carry_the_inputs_envelope_and_a_msg_id_per_index() -> None:
    store = MemoryStore()
    folder = Folder(TOY)
    inp = await put(store, subjects.job("j1", "JobSubmitted"), submitted("j1", at=123.5))
    [only] = folder.apply(inp)
    [out] = only.outputs
    assert out.subject == "fd.ctl.job.j1.JobQueued"
    assert out.msg_id == f"toy:FD_CONTROL:{inp.seq}:0"
    assert out.event.event_id == out.msg_id
    assert out.event.occurred_at == 123.5
    assert out.event.causation_id == "cli-j1"
    assert out.event.producer == "toy"
    assert isinstance(out.event, JobQueued) and out.event.priority == 1
    assert folder.control_seq == inp.seq and folder.state.submitted == 1


async def test_a_tick_folds_telemetry_up_to_its_recorded_position_then_itself() -> None:
    store = MemoryStore()
    folder = Folder(TOY)
    tel = [await put(store, subjects.telemetry("j1", r, "StepCompleted"), step("j1", r, n))
           for n in (1, 2) for r in (0, 1)]
    t = await put(store, subjects.clock("toy"), tick(10.0, tel[2].seq))
    steps = folder.apply(t, tel[:3])
    assert [s.input.seq for s in steps] == [tel[0].seq, tel[1].seq, tel[2].seq, t.seq]
    assert [s.input.stream for s in steps] == ["FD_TELEMETRY"] * 3 + ["FD_CONTROL"]
    assert steps[1].outputs[0].msg_id == f"toy:FD_TELEMETRY:{tel[1].seq}:0"
    assert steps[1].outputs[0].event.causation_id == "j1-1-1"
    assert folder.state.steps == (("j1", 0, 1), ("j1", 1, 1), ("j1", 0, 2))
    assert folder.telemetry_seq == tel[2].seq and folder.state.ticks == 1


async def test_a_failing_core_costs_one_input_and_keeps_its_state() -> None:
    store = MemoryStore()
    folder = Folder(TOY)
    folder.apply(await put(store, subjects.job("j1", "JobSubmitted"), submitted("j1")))
    [bad] = folder.apply(await put(store, subjects.job("j1", "CancelRequested"),
                                   CancelRequested(job_id="j1", reason="boom")))
    assert bad.outputs == () and bad.error.startswith("core failed: RuntimeError: boom requested at ")
    assert "test_fold.py" in bad.error
    [good] = folder.apply(await put(store, subjects.job("j2", "JobSubmitted"), submitted("j2")))
    assert folder.state.submitted == 2 and good.error == ""
    assert isinstance(good.outputs[0].event, JobQueued) and good.outputs[0].event.priority == 2


async def test_undecodable_and_misaddressed_inputs_are_refused_with_a_reason() -> None:
    folder = Folder(TOY)
    junk = decoded("FD_CONTROL", 1, "fd.ctl.job.j1.JobSubmitted", b"\xc1not msgpack", "")
    [s1] = folder.apply(junk)
    assert s1.error.startswith("undecodable: ") and s1.outputs == ()
    wrong_job = decoded("FD_CONTROL", 2, "fd.ctl.job.j2.JobSubmitted", encode(submitted("j1")), "")
    [s2] = folder.apply(wrong_job)
    assert s2.error.startswith("invalid: ") and "fd.ctl.job.j2.JobSubmitted" in s2.error
    other = msgspec.structs.replace(tick(1.0, 0), service="other")
    foreign_tick = decoded("FD_CONTROL", 3, "fd.ctl.clock.toy", encode(other), "")
    [s3] = folder.apply(foreign_tick)
    assert s3.error.startswith("invalid: ")
    assert folder.state == Tally() and folder.control_seq == 3


async def test_effects_come_back_beside_emits_and_an_unknown_one_is_a_core_error() -> None:
    store = MemoryStore()
    folder = Folder(TOY)
    [s] = folder.apply(await put(store, subjects.job("j1", "JobSubmitted"), submitted("j1", priority=7)))
    assert s.effects == (Effect("upload", "j1"),) and len(s.outputs) == 1
    [u] = folder.apply(await put(store, subjects.job("j2", "JobSubmitted"), submitted("j2", priority=8)))
    assert "teleport" in u.error and folder.state.submitted == 1


async def _live(ops: list[tuple[str, int]]) -> tuple[MemoryStore, list[Step]]:
    """What the shell does: telemetry is buffered as it arrives, ticks record the buffered position, and
    control inputs are folded in stream order, telemetry handed over at the service's own ticks."""
    store = MemoryStore()
    folder = Folder(TOY)
    buffered: list[Stored] = []
    live: list[Step] = []
    now = 0.0
    for k, (op, arg) in enumerate(ops, start=1):
        if op == "submit":
            await append(store, subjects.job(f"j{arg}", "JobSubmitted"), submitted(f"j{arg}", at=now, event_id=f"s{k}"))
        elif op == "step":
            sent = step("j0", arg % 2, arg, nonce=k)
            buffered.append(await put(store, subjects.telemetry("j0", arg % 2, "StepCompleted"), sent))
        elif op == "tick":
            now += 1.0
            pos = buffered[-1].seq if buffered else folder.telemetry_seq
            await store.append(subjects.clock("toy"), tick(now, pos))
        async for batch in store.read(subjects.CONTROL, [*TOY.control_subjects, subjects.clock("toy")],
                                      from_seq=folder.control_seq + 1):
            for stored in batch:
                pos_ = folder.tick_position(stored)
                due = [t for t in buffered if pos_ is not None and folder.telemetry_seq < t.seq <= pos_]
                steps = folder.apply(stored, due)
                live += steps
                for out in outputs_of(steps):
                    await append(store, out.subject, out.event, msg_id=out.msg_id)
    return store, live


OPS = st.lists(st.tuples(st.sampled_from(["submit", "step", "step", "tick"]), st.integers(0, 50)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_replay_reproduces_the_live_fold_exactly(ops: list[tuple[str, int]]) -> None:
    async def check() -> None:
        store, live = await _live(ops)
        replayed = [s async for s in replay(TOY, store)]
        assert [(s.input.stream, s.input.seq) for s in replayed] == [(s.input.stream, s.input.seq) for s in live]
        assert [comparable(o.event) for o in outputs_of(replayed)] == [comparable(o.event) for o in outputs_of(live)]
        folded = [(s.input.event.job_id, s.input.event.step) for s in live
                  if isinstance(s.input.event, StepCompleted)]
        rebuilt = await rebuild(TOY, store, until=await store.last_seq("FD_CONTROL"))
        assert [(j, n) for j, _, n in rebuilt.state.steps] == folded
    asyncio.run(check())


async def test_rebuild_stops_at_the_given_sequence_and_replay_resumes_from_a_folder() -> None:
    store = MemoryStore()
    seqs = [(await append(store, subjects.job(f"j{i}", "JobSubmitted"), submitted(f"j{i}"))).seq for i in range(5)]
    folder = await rebuild(TOY, store, until=seqs[2])
    assert folder.state.submitted == 3 and folder.control_seq == seqs[2]
    rest = [s async for s in replay(TOY, store, folder=folder)]
    assert [s.input.seq for s in rest] == seqs[3:]
    assert [o.event.priority for o in outputs_of(rest) if isinstance(o.event, JobQueued)] == [4, 5]


async def test_the_tap_buffers_within_its_bound_and_reads_what_it_dropped_from_the_store() -> None:
    store = MemoryStore()
    tel = [await put(store, subjects.telemetry("j1", 0, "StepCompleted"), step("j1", 0, n)) for n in range(10)]
    tap = TelemetryTap(store, TOY.telemetry_subjects, limit=3)
    tap.start(0)
    for _ in range(50):
        if tap.seen == tel[-1].seq:
            break
        await asyncio.sleep(0.01)
    await tap.stop()
    assert tap.seen == tel[-1].seq and len(tap.items) == 3 and tap.complete == tel[2].seq
    tap.offer(tel[4])  # a repeat of something already seen changes nothing
    assert len(tap.items) == 3
    first = await tap.take(0, tel[6].seq)
    assert [t.seq for t in first] == [t.seq for t in tel[:7]]
    rest = await tap.take(tel[6].seq, tel[9].seq)
    assert [t.seq for t in rest] == [t.seq for t in tel[7:]] and not tap.items
