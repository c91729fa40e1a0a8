"""The contract every service's pure core fulfils, and the outputs a core may return.

Why it works this way: docs/internals.md, "2. Cores and the shell".
"""

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from flightdeck.events.base import Event
from flightdeck.events.store import EventStore

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Emit:
    """One output: append `event` under `subject`. On a job subject the shell appends it to the job's
    history, which assigns the next contiguous `job_version`."""

    subject: str
    event: Event


@dataclass(frozen=True, slots=True)
class Effect:
    """Work with I/O that a core asks the shell to do (upload a checkpoint, spawn ranks).

    A transition may return Effects beside Emits. The shell calls `service.effects[kind](args)`, which
    returns the events that record what happened (e.g. CheckpointCommitted); they are appended like
    Emits, their msg ids continuing the input's output index, before the input is acked (the shell
    marks the input in progress while a long effect runs). A replay does not run effects: it reads
    their recorded events back as inputs like any other.
    """

    kind: str
    args: Any


Output = Emit | Effect
EffectHandler = Callable[[Any], Awaitable[Sequence[Emit]]]


@dataclass(frozen=True)
class Service(Generic[S]):
    """A service's pure core plus the subjects it reads.

    - `transition(state, event) -> (state, outputs)` folds one input and decides in one pure function:
      outputs are Emits (decisions, verified on replay) and Effects (I/O whose results are recorded). It
      returns a new state and leaves the one it was given as it was, so a transition that raises costs the
      fold nothing. A core that updates its state in place for speed (health) names `copy` instead: the fold
      keeps a copy and, when a transition raises, rebuilds the state before that input from it.
    - `wants_tick(state, now) -> bool` lets a core say it has nothing time-dependent to watch, so an
      idle service records no ticks.
    """

    name: str
    initial: S
    transition: Callable[[S, Event], tuple[S, Sequence[Output]]]
    control_subjects: tuple[str, ...]  # filters on FD_CONTROL (its own clock subject is added)
    telemetry_subjects: tuple[str, ...] = ()  # filters on FD_TELEMETRY, folded at ticks
    tick_s: float = 1.0
    # Telemetry types whose arrival brings the next tick forward (to PROMPT_S after it), so that what they
    # start is decided within a fraction of `tick_s` without ticking that often when nothing comes; such a tick
    # comes even where `wants_tick` says no by then.
    prompt_types: frozenset[str] = frozenset()
    wants_tick: Callable[[S, float], bool] = field(default=lambda state, now: True)
    effects: Mapping[str, EffectHandler] = field(default_factory=dict)
    # Effect kinds too long to hold the inputs up for (a scrub reads a whole checkpoint back at a bounded rate):
    # the shell runs them in the background and appends their outcome when done. The core must expect none (a
    # crash loses a run in flight) and may ask again later; a replay reads an outcome back like any other.
    detached: frozenset[str] = frozenset()
    copy: Callable[[S], S] | None = None  # only for a core whose transition changes the state it is given
    # Effects that read the streams (the archiver's) get the shell's event store through this, once connected.
    bind: Callable[[EventStore], None] | None = None
    # What the core was built with, recorded as CoreConfigured when its shell starts; the core folds that event
    # back into its state, so live and replayed decisions use the same values.
    settings: Mapping[str, float | int | str] = field(default_factory=dict)
    # What a history that recorded no settings replays with, where that differs from `settings`: its services ran
    # before settings were recorded, with the behaviour these name (None: `settings`).
    unrecorded: Mapping[str, float | int | str] | None = None
