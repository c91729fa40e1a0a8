"""The contract every service's pure core fulfils, and the outputs a core may return.

A core never does I/O: the shell (services/runtime.py) feeds it decoded events in a recorded
order and stores what it returns. The same cores run live, on a restart's rebuild, and in
`flightdeck verify` / `whatif`, which is why they must be deterministic functions of their inputs.

Ordering rule. A service reads FD_CONTROL in stream order, its own `ClockTick`s included (they are
appended to `fd.ctl.clock.<service>` and come back through the same consumer). A service that also
reads FD_TELEMETRY folds telemetry only when one of its ticks comes back, and exactly up to the
telemetry sequence the tick recorded in `positions`. So the interleaving of the two streams is itself
in the log, and a replay sees the same order as the live run did.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from events.base import Event

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Emit:
    """One output: append `event` under `subject`. On a job subject the shell appends it to the job's
    history, which assigns the next contiguous `job_version`."""

    subject: str
    event: Event


@dataclass(frozen=True)
class Service(Generic[S]):
    """A service's pure core plus the subjects it reads.

    - `evolve(state, event) -> state` folds one input into state (no decisions).
    - `decide(state, event) -> outputs` is called right after `evolve` with the new state.
    - `wants_tick(state, now) -> bool` lets a core say it has nothing time-dependent to watch, so an
      idle service records no ticks.
    """

    name: str
    initial: S
    evolve: Callable[[S, Event], S]
    decide: Callable[[S, Event], Sequence[Emit]]
    control_subjects: tuple[str, ...]  # filters on FD_CONTROL (its own clock subject is added)
    telemetry_subjects: tuple[str, ...] = ()  # filters on FD_TELEMETRY, folded at ticks
    tick_s: float = 1.0
    wants_tick: Callable[[S, float], bool] = field(default=lambda state, now: True)
