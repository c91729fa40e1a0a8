"""Which committed checkpoints a rollback threw away: the one rule the checkpoint service, the scheduler (which
chooses what a restart restores, and records it: RestorePoint) and the client (a new job adopting an ended one's
checkpoint) share.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

from collections.abc import Iterable
from typing import Protocol, TypeVar

import msgspec

from flightdeck.events.commands import RollbackRequested


class Fork(msgspec.Struct, frozen=True, kw_only=True):
    """Timeline `timeline` of `attempt` branched off at `to_step`, skipping batches [skip_from, skip_to)."""

    attempt: int
    timeline: int
    to_step: int
    skip_from: int = 0
    skip_to: int = 0


def forked(forks: tuple[Fork, ...], ev: RollbackRequested) -> tuple[Fork, ...]:
    """`forks` with the timeline `ev` starts."""
    timeline = 1 + max((f.timeline for f in forks if f.attempt == ev.attempt), default=0)
    return (*forks, Fork(attempt=ev.attempt, timeline=timeline, to_step=ev.to_step, skip_from=ev.skip_from,
                         skip_to=ev.skip_to))


def restore_skips(forks: tuple[Fork, ...], attempt: int, timeline: int, step: int) -> tuple[tuple[int, int], ...]:
    """The batch windows a restore of the checkpoint of (attempt, timeline, step) applies itself: those of the
    rollbacks decided back to that step after it was staged. Its own data position cannot hold them, and a restart
    that follows such a rollback (whether or not the ranks obeyed it first) must not train those batches again."""
    return tuple((f.skip_from, f.skip_to) for f in forks
                 if f.to_step == step and f.skip_to > f.skip_from and (f.attempt, f.timeline) > (attempt, timeline))


def thrown_away(forks: tuple[Fork, ...], attempt: int, timeline: int, step: int) -> bool:
    """Whether the checkpoint of (attempt, timeline, step) holds steps a rollback threw away."""
    return any(f.attempt == attempt and timeline < f.timeline and step > f.to_step for f in forks)


class Staged(Protocol):
    """A committed checkpoint as the restore rule reads it: its step and the (attempt, timeline) that staged it."""

    @property
    def step(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def timeline(self) -> int: ...


C = TypeVar("C", bound=Staged)


def newest(checkpoints: Iterable[C], forks: tuple[Fork, ...]) -> C | None:
    """What a restart restores, the scheduler's choice and every node agent's: the highest step no rollback threw
    away; among equal steps the one committed last (`checkpoints` in commit order)."""
    best: C | None = None
    for c in checkpoints:
        if not thrown_away(forks, c.attempt, c.timeline, c.step) and (best is None or c.step >= best.step):
            best = c
    return best
