"""When the checkpoint service's core asks for a scrub: only when one is due (`scrub_every_s` since the checkpoint
was last verified), oldest-verified first across jobs, one at a time until its outcome or deadline; what a
finding does: a good one moves the checkpoint to the back, a bad one deletes it as such."""

from msgspec.structs import replace

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointScrubbed, DataPosition
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.job import JobCancelled, JobFailed, JobSubmitted
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.services.checkpoints import core
from flightdeck.services.checkpoints.core import SCRUBBED_BAD
from flightdeck.services.checkpoints.scrubs import SCRUB, SCRUB_SLACK_S
from flightdeck.services.checkpoints.state import ScrubArgs, Settings
from flightdeck.services.core import Effect, Emit, Output

EVERY = 100.0
MB_S = 2.0


def commit(job: str, step: int, at: float, size: int = 4_000_000) -> CheckpointCommitted:
    return CheckpointCommitted(job_id=job, checkpoint_id=f"{job}-{step}", step=step, world_size=1, uri="u",
                               bytes=size, data=DataPosition(next_batch=step), manifest_sha256=f"m-{step}",
                               occurred_at=at)


def tick(now: float) -> ClockTick:
    return ClockTick(service=core.SERVICE, now=now, positions={}, occurred_at=now)


def scrubbed(job: str, step: int, at: float, cause: str = "") -> CheckpointScrubbed:
    return CheckpointScrubbed(job_id=job, checkpoint_id=f"{job}-{step}", step=step, bytes=1, seconds=1.0,
                              cause=cause, occurred_at=at)


def fold(events: list[Event], state: core.State | None = None) -> tuple[core.State, list[Output]]:
    state = state or core.State()
    outs: list[Output] = []
    for ev in events:
        state, out = core.transition(state, ev)
        outs.extend(out)
    return state, outs


def scrubs(outs: list[Output]) -> list[str]:
    return [o.args.checkpoint_id for o in outs if isinstance(o, Effect) and o.kind == SCRUB]


def configured(every: float = EVERY) -> CoreConfigured:
    return CoreConfigured(service=core.SERVICE, settings={"scrub_every_s": every, "scrub_mb_s": MB_S})


def submitted(job: str) -> JobSubmitted:
    return JobSubmitted(job_id=job, spec=JobSpec(name="j", train=TrainSpec(steps=100, checkpoint_every=10)))


# Ended jobs: their checkpoints stay in the store, and the service ticks for nothing but scrubs.
START = [configured(), submitted("a"), submitted("b"), commit("a", 10, at=5.0), commit("b", 10, at=1.0),
         commit("a", 20, at=9.0), JobFailed(job_id="a", reason="r", causes=[]), JobCancelled(job_id="b", reason="r")]


def test_nothing_is_read_back_before_it_is_due_nor_when_scrubs_are_off() -> None:
    state, outs = fold([*START, tick(100.0)])
    assert scrubs(outs) == [] and not core.wants_tick(state, 100.0)
    assert core.wants_tick(state, 101.0)  # b-10, committed at 1.0, is due at 101
    _, outs = fold([configured(0.0), *START[1:], tick(10_000.0)])
    assert scrubs(outs) == []


def test_the_oldest_verified_goes_first_one_at_a_time_and_a_good_finding_sends_it_to_the_back() -> None:
    state, outs = fold([*START, tick(200.0)])
    (effect,) = [o for o in outs if isinstance(o, Effect)]
    assert effect.args == ScrubArgs(job_id="b", checkpoint_id="b-10", step=10, manifest_sha256="m-10",
                                    bytes_per_s=MB_S * 1e6)
    state, outs = fold([tick(201.0), tick(202.0)], state)
    assert scrubs(outs) == [] and not core.wants_tick(state, 203.0)  # one in flight: nothing more
    state, outs = fold([scrubbed("b", 10, at=203.0), tick(204.0)], state)
    assert scrubs(outs) == ["a-10"]  # b-10 was verified at 203 now: the back of the line
    state, outs = fold([scrubbed("a", 10, at=205.0), tick(206.0), scrubbed("a", 20, at=207.0), tick(208.0)], state)
    assert scrubs(outs) == ["a-20"] and state.scrub is None
    assert not core.wants_tick(state, 302.0) and core.wants_tick(state, 303.0)


def test_a_scrub_with_no_outcome_by_its_deadline_is_asked_for_again() -> None:
    state, outs = fold([*START, tick(200.0)])
    deadline = 200.0 + SCRUB_SLACK_S + 2 * 4_000_000 / (MB_S * 1e6)
    assert scrubs(outs) == ["b-10"] and state.scrub is not None and state.scrub.deadline == deadline
    _, outs = fold([tick(deadline - 1)], state)
    assert scrubs(outs) == []
    _, outs = fold([tick(deadline)], state)
    assert scrubs(outs) == ["b-10"]  # the process that ran it died: still the oldest verified


def test_a_bad_finding_deletes_the_checkpoint_as_such_and_a_finding_about_a_deleted_one_changes_nothing() -> None:
    state, outs = fold([*START, tick(200.0), scrubbed("b", 10, at=201.0, cause="shard x: sha256 differs")])
    (deleted,) = [o.event for o in outs if isinstance(o, Emit) and isinstance(o.event, CheckpointDeleted)]
    assert (deleted.checkpoint_id, deleted.reason) == ("b-10", SCRUBBED_BAD)
    state, outs = fold([CheckpointDeleted(job_id="b", checkpoint_id="b-10", reason=SCRUBBED_BAD), tick(10_000.0)],
                       state)
    assert scrubs(outs) == ["a-10"]  # never the deleted one again
    after, outs = fold([scrubbed("b", 10, at=10_001.0, cause="late")], state)
    assert outs == [] and after.jobs["b"] == state.jobs["b"]


def test_settings_out_of_range_are_refused() -> None:
    for bad in ({"scrub_every_s": -1.0}, {"scrub_mb_s": 0.0}):
        try:
            replace(Settings(), **bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
