"""The node agent's heartbeat batches (services/resources/beats.Batches): each rank's newest beat per job and
attempt, one batch per interval, nothing lost or repeated between batches."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events import codec
from flightdeck.events.heartbeats import LocalBeat
from flightdeck.services.agent.beats import IDLE_GROUPS_AFTER, Batches


def beat(rank: int, at: float, step: int = 3, job: str = "j-000001", attempt: int = 0, interval: float = 1.0,
         step_time: float = 0.0) -> LocalBeat:
    return LocalBeat(job_id=job, attempt=attempt, rank=rank, step=step, occurred_at=at, interval_s=interval,
                     step_time_s=step_time)


def test_a_first_beat_goes_out_at_once_and_the_next_ones_one_interval_later() -> None:
    b = Batches("n1", "agent-n1", "boot")
    assert b.add(beat(3, 100.0), now=10.0) is True  # nothing was pending: the flusher must wake
    due = b.due_at()
    assert due is not None and due <= 10.0
    (first,) = b.take_due(10.0, 100.0)
    assert [x.rank for x in first.beats] == [3] and first.rank == 3 and first.node == "n1"
    assert b.add(beat(2, 100.5), now=10.5) is True
    assert b.add(beat(3, 100.6), now=10.6) is False
    assert b.take_due(10.9, 100.9) == []  # not due yet
    assert b.due_at() == 11.0
    (second,) = b.take_due(11.0, 101.0)
    assert [x.rank for x in second.beats] == [2, 3] and second.rank == 2  # the lowest rank seen names the subject
    assert second.event_id != first.event_id and second.producer == "agent-n1"
    assert codec.admit(codec.encode(second)) == second  # within the codec's bounds


def test_the_newest_beat_of_a_rank_wins_and_keeps_its_steps_time() -> None:
    b = Batches("n1", "agent-n1", "boot")
    b.add(beat(0, 100.0, step=7, step_time=0.2), now=1.0)
    b.add(beat(0, 100.5, step=7), now=1.5)  # a later beat of the same step carries no time of its own
    b.add(beat(0, 99.0, step=6, step_time=0.3), now=1.6)  # an older beat arriving late changes nothing
    (batch,) = b.take_due(2.0, 102.0)
    (only,) = batch.beats
    assert (only.step, only.occurred_at, only.step_time_s) == (7, 100.5, 0.2)


def test_jobs_and_attempts_batch_apart_and_idle_ones_are_forgotten() -> None:
    b = Batches("n1", "agent-n1", "boot")
    b.add(beat(0, 1.0, job="a-000001"), now=0.0)
    b.add(beat(1, 1.0, job="b-000001"), now=0.0)
    b.add(beat(0, 1.0, job="a-000001", attempt=1), now=0.0)
    out = b.take_due(0.0, 1.0)
    assert sorted((x.job_id, x.attempt) for x in out) == [("a-000001", 0), ("a-000001", 1), ("b-000001", 0)]
    assert b.take_due(IDLE_GROUPS_AFTER + 1.0, 2.0) == [] and b.groups == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.floats(0.0, 0.5), st.integers(-1, 50)), max_size=80),
       st.floats(0.2, 2.0))
def test_every_rank_that_beat_is_in_the_next_batch_once_with_its_newest_beat(
        beats: list[tuple[int, float, int]], interval: float) -> None:
    b = Batches("n1", "agent-n1", "boot")
    now, wall = 0.0, 1000.0
    newest: dict[int, tuple[int, float]] = {}
    sent: list[float] = []
    for rank, gap, step in beats:
        now += gap
        wall += gap
        b.add(beat(rank, wall, step=step, interval=interval), now=now)
        newest[rank] = (step, wall)
        for batch in b.take_due(now, wall):
            assert len({x.rank for x in batch.beats}) == len(batch.beats)  # a rank at most once
            assert all(newest[x.rank] == (x.step, x.occurred_at) for x in batch.beats)
            assert not sent or now - sent[-1] >= interval - 1e-9  # never more than one batch per interval
            sent.append(now)
            newest = {r: v for r, v in newest.items() if r not in {x.rank for x in batch.beats}}
    due = b.due_at()
    assert (due is None) == (not newest)  # whatever is still pending will go out
    if due is not None:
        (last,) = b.take_due(due, wall)
        assert {x.rank for x in last.beats} == set(newest)


def test_a_held_attempt_is_batched_every_interval_even_with_no_beat_until_released() -> None:
    """The agent's own liveness: while it runs an attempt's ranks it sends that group's batch every interval, empty
    when no rank beat (a hung rank, a rank still importing torch), and stops once their last rank exits."""
    b = Batches("n1", "agent-n1", "boot")
    b.hold("j-000001", 0, 0.5, low=4, now=10.0)
    assert b.due_at() is not None and b.due_at() <= 10.0
    (first,) = b.take_due(10.0, 100.0)
    assert (first.beats, first.rank, first.interval_s, first.attempt) == ([], 4, 0.5, 0)
    b.add(beat(5, 100.2, interval=0.5), now=10.2)
    (second,) = b.take_due(10.5, 100.5)
    assert [x.rank for x in second.beats] == [5] and second.rank == 4
    sent = [len(b.take_due(10.5 + k * 0.5, 100.5 + k * 0.5)) for k in range(1, 5)]
    assert sent == [1, 1, 1, 1]  # nothing beat: one empty batch per interval all the same
    b.release("j-000001", 0)
    assert b.take_due(13.0, 103.0) == [] and b.due_at() is None
    assert b.take_due(13.0 + IDLE_GROUPS_AFTER * 0.5 + 1, 110.0) == [] and b.groups == {}  # then forgotten
