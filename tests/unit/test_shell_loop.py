"""The shell's loop (services/shell/loop.py), run here through the explorer's port (SimShell) on the simulated broker:
the same loop the live shell runs on NATS."""

from flightdeck.events import subjects
from flightdeck.events.clock import DeadLettered
from flightdeck.events.history import append_to_job
from flightdeck.events.job import JobQueued, JobSubmitted
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import MemoryStore
from flightdeck.services.core import Effect, Emit
from flightdeck.services.shell import deadletter
from flightdeck.services.tools.explore.broker import SimBroker
from flightdeck.services.tools.explore.shell import SimShell
from tests.integration import toy_service


async def _no_effects(service: str, effect: Effect) -> list[Emit]:
    raise AssertionError("the toy asks for none")


def _shell(store: MemoryStore, broker: SimBroker) -> SimShell:
    n = iter(range(1, 10_000))
    return SimShell(toy_service.build, store, broker, lambda: 1_800_000_000.0, _no_effects, lambda: next(n))


async def _submitted(store: MemoryStore, k: int) -> None:
    for i in range(k):
        job = f"j{i}-000000"
        await append_to_job(store, JobSubmitted(job_id=job, spec=JobSpec(name="j"), event_id=f"cli-{job}",
                                                occurred_at=1.0, producer="cli"))


def _letters(store: MemoryStore) -> list[DeadLettered]:
    return [s.event for s in store.rows(subjects.DEAD) if isinstance(s.event, DeadLettered)]


async def test_an_input_given_up_after_the_rebuild_folded_it_is_recorded_as_folded() -> None:
    """A process folded three inputs, stored their outputs and ticked, and died before the acks reached the broker's
    disk. The next one rebuilds through them from its tick; then the server gives the third up (its deliveries ran
    out meanwhile). It is in the state: a replay must fold it too, so it is recorded as folded, not given up.
    (Before the loop was shared, the live shell counted only inputs its own process had handled.)"""
    store = MemoryStore()
    broker = SimBroker(store)
    await _submitted(store, 3)
    first = _shell(store, broker)
    await first.start()
    for _ in range(3):
        assert await first.one()
    assert [s.event.priority for s in store.rows(subjects.CONTROL) if isinstance(s.event, JobQueued)] == [1, 2, 3]
    await first.tick()
    assert await first.one()  # its tick: it records the three as done
    broker.restart()  # the acks were never flushed

    second = _shell(store, broker)
    await second.start()
    assert second.folder.state.jobs == 3  # rebuilt from its own tick
    third = next(s for s in store.rows(subjects.CONTROL) if isinstance(s.event, JobSubmitted)
                 and s.event.job_id == "j2-000000")
    await second.loop.given_up(third, 5)
    (letter,) = _letters(store)
    assert letter.seq == third.seq and letter.event_id.endswith(f":{deadletter.FOLDED_ANYWAY}")
    assert third.seq not in await deadletter.given_up(store, "toy")  # replays fold it, as the state holds it


async def test_an_input_never_folded_is_recorded_as_given_up_and_replays_skip_it() -> None:
    store = MemoryStore()
    broker = SimBroker(store)
    await _submitted(store, 2)
    shell = _shell(store, broker)
    await shell.start()
    assert await shell.one()
    second = next(s for s in store.rows(subjects.CONTROL) if isinstance(s.event, JobSubmitted)
                  and s.event.job_id == "j1-000000")
    await shell.loop.given_up(second, 5)
    assert await deadletter.given_up(store, "toy") == {second.seq}

