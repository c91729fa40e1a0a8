"""A core that raises part-way through an input costs that input and nothing else: for every core and every input
of two recorded drills, a transition that fails after it ran (an in-place core has changed its state by then)
leaves the fold exactly where a transition that failed before touching anything does. Every other decision
comes out the same, none lost and none doubled.

Before the fold undid failed transitions, the health core lost decisions this way: a finding marked as
reported in the half-changed state was never emitted.
"""

from dataclasses import replace
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from flightdeck.events.base import Event
from flightdeck.services.core import Service
from flightdeck.services.shell.fold import Folder, comparable, replay
from flightdeck.services.tools.audit.cores import ADDED_LATER, cores
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.library import History

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "histories"
DRILLS = ("spike", "crash")


class Injected(RuntimeError):
    pass


def failing(service: Service[Any], at: int, after: bool) -> Service[Any]:
    """`service` whose `at`-th transition (from 0) raises: before it runs, or after it ran on the state."""
    calls = count()

    def transition(state: Any, event: Event) -> tuple[Any, Any]:
        n = next(calls)
        if n == at and not after:
            raise Injected(f"before input {at}")
        result = service.transition(state, event)
        if n == at and after:
            raise Injected(f"after input {at}")
        return result

    return replace(service, transition=transition)


async def run(service: Service[Any], history: History) -> tuple[list[tuple[int, bool, list[dict[str, Any]]]], int]:
    """Every input folded: (sequence, whether it failed, outputs as a replay compares them), and the events
    folded again to undo failures."""
    folder = Folder(service)
    steps = [(s.input.seq, "core failed: Injected" in s.error, [comparable(o.event) for o in s.outputs])
             async for s in replay(service, history.store, folder=folder, skip=set())]
    return steps, folder.num_refolded


def history(drill: str) -> History:
    return History(job_id=f"{drill}-000001", rows=fdh.load(FIXTURES / f"{drill}.fdh.jsonl"), source=drill)


def services() -> list[Any]:
    # the fixtures were recorded before the archiver ran (its frozen core returns a new state: a transition that
    # raises leaves nothing behind; tests/unit/test_archiver_core.py pins its decisions)
    return [pytest.param(service, id=service.name) for service in cores() if service.name not in ADDED_LATER]


@pytest.mark.parametrize("drill", DRILLS)
@pytest.mark.parametrize("service", services())
async def test_a_failed_transition_loses_and_doubles_no_decision(service: Service[Any], drill: str) -> None:
    recorded = history(drill)
    clean, _ = await run(service, recorded)
    assert clean and not any(failed for _, failed, _ in clean)
    assert any(outputs for _, _, outputs in clean), f"{service.name} decides nothing in the {drill} drill"
    refolded = 0
    for at in range(len(clean)):
        skipped, _ = await run(failing(service, at, after=False), recorded)
        broken, undone = await run(failing(service, at, after=True), recorded)
        refolded += undone
        assert skipped[at][1] and broken[at][1]
        assert broken == skipped, f"{service.name}: input {at} of {drill} failed part-way and changed what followed"
    if service.copy is not None:
        assert refolded > 0, "the undo never had events to fold again: the test did not reach that path"
