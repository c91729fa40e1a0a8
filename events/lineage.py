"""Which committed checkpoints a rollback threw away: the one rule the checkpoint service, the scheduler and the
node agents share, so a restart restores the same checkpoint whoever picks it.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import msgspec

from events.commands import RollbackRequested


class Fork(msgspec.Struct, frozen=True, kw_only=True):
    """Timeline `timeline` of `attempt` branched off at `to_step`."""

    attempt: int
    timeline: int
    to_step: int


def forked(forks: tuple[Fork, ...], ev: RollbackRequested) -> tuple[Fork, ...]:
    """`forks` with the timeline `ev` starts."""
    timeline = 1 + max((f.timeline for f in forks if f.attempt == ev.attempt), default=0)
    return (*forks, Fork(attempt=ev.attempt, timeline=timeline, to_step=ev.to_step))


def thrown_away(forks: tuple[Fork, ...], attempt: int, timeline: int, step: int) -> bool:
    """Whether the checkpoint of (attempt, timeline, step) holds steps a rollback threw away."""
    return any(f.attempt == attempt and timeline < f.timeline and step > f.to_step for f in forks)
