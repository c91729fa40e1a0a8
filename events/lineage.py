"""Which committed checkpoints a rollback threw away: the one rule the checkpoint service, the scheduler and the
node agents share, so a restart restores the same checkpoint whoever picks it.

An attempt's ranks start on timeline 0; each rollback they apply moves them to the next one (trainer/loop.py
counts them and stamps the number on every CheckpointStaged, so a step redone after a rollback is a different
checkpoint). The k-th RollbackRequested of an attempt starts its timeline k at the rollback's step: from then
on, that attempt's checkpoints above the step from an older timeline hold steps the rollback threw away
(trained on the batches it skips). They are never restored nor rolled back to, and retention deletes them.

Folding the commands, not the ranks' RolledBack reports, keeps the rule a function of the control history
alone, which every party reads in the same order. Should a rank apply fewer rollbacks than were requested of
its attempt (a command it never received), its later checkpoints look older than they are and count as
thrown away: a restart then goes further back than it had to, never onto a thrown-away timeline.
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
