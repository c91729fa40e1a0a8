"""Every core, fed short runs of hostile events of the types it reads, through the fold the shell runs
(bytes decoded by the store's `admit`, subjects checked, core called): no exception escapes, no input keeps
a core busy, a refused input leaves the state as it was, and the core still answers good inputs after."""

import copy
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flightdeck.events import subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.catalog import BY_NAME
from tests.badinput import cores, hostile

EXAMPLES = 120


def _read_types(name: str) -> list[str]:
    service = cores.services()[name]()
    pats = (*service.control_subjects, *service.telemetry_subjects)
    return sorted({p.rsplit(".", 1)[-1] for p in pats} & set(BY_NAME))


NAMES = list(cores.services())
PRIMED = {name: cores.primed(name) for name in NAMES}
KINDS = {name: st.one_of([hostile.events(BY_NAME[t]) for t in _read_types(name)]) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
@given(data=st.data())
def test_hostile_events_never_break_a_core(name: str, data: st.DataObject) -> None:
    run = data.draw(st.lists(KINDS[name], min_size=1, max_size=3), label="hostile inputs")
    folder = copy.deepcopy(PRIMED[name])
    seq = folder.control_seq
    for event in run:
        seq += 1
        if isinstance(event, JobEvent) and event.job_version == 0:  # sane: numbered next, so it reaches the core
            event = msgspec.structs.replace(event, job_version=folder.admission.versions.get(event.job_id, 0) + 1)
        before = _shape(folder.state)
        with cores.time_limit(3.0):
            step = folder._fold(cores.stored(event, seq))
        if step.error:
            assert _shape(folder.state) == before, f"{name} kept part of a refused input: {step.error}"
    for good in cores.good_inputs(seq + 1):
        if not any(subjects.matches(p, good.subject) for p in folder.service.control_subjects):
            continue
        with cores.time_limit(3.0):
            after = folder._fold(good)
        assert not after.error, f"{name} broke on a good input after {run!r}: {after.error}"


def test_a_node_announcing_a_billion_slots_is_refused_before_placement_loops_over_them() -> None:
    """Found by this fuzz: resources folded NodeRegistered(slots=10**9) and the next AllocationRequested
    spent minutes listing free slots. The bounds refuse it at decode now."""
    from flightdeck.events.fleet import NodeRegistered
    from flightdeck.events.job import AllocationRequested

    folder = copy.deepcopy(PRIMED["resources"])
    step = folder._fold(cores.stored(NodeRegistered(node="n9", kind="cpu", slots=10**9, event_id="big"), 100))
    assert step.error.startswith("undecodable: NodeRegistered out of bounds") and "$.slots" in step.error
    with cores.time_limit(3.0):
        ok = folder._fold(cores.stored(AllocationRequested(job_id="k-1", slots=3, attempt=0, event_id="ask",
                                                           job_version=1), 101))
    assert not ok.error


def _same(a: Any, b: Any) -> bool:
    return _shape(a) == _shape(b)


def _shape(x: Any) -> Any:
    """A comparable picture of a state, mutable objects included (the health core keeps watchers)."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, str | int | bool | bytes | None):
        return x
    if isinstance(x, dict):
        return sorted((repr(k), _shape(v)) for k, v in x.items())
    if isinstance(x, set | frozenset):
        return sorted(repr(_shape(v)) for v in x)
    if isinstance(x, list | tuple) or type(x).__name__ == "deque":
        return [_shape(v) for v in x]
    names = getattr(type(x), "__struct_fields__", None) or getattr(x, "__slots__", None)
    fields = {n: getattr(x, n) for n in names if hasattr(x, n)} if names else dict(vars(x))
    return (type(x).__name__, sorted((k, _shape(v)) for k, v in fields.items()))
