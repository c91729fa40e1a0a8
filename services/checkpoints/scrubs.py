"""When the checkpoint service reads a committed checkpoint back from the store (a scrub): the one verified longest
ago across all jobs, one at a time, at most `Settings.scrub_mb_s`. Pure functions of the service's state."""

from collections.abc import Sequence

from msgspec.structs import replace

from flightdeck.services.checkpoints.state import Committed, Scrub, ScrubArgs, State
from flightdeck.services.core import Effect, Output

SCRUB = "scrub"
SCRUB_SLACK_S = 300.0  # a scrub with no outcome this long past its bytes' reading time counts as lost: asked again


def scrub_due(state: State, now: float) -> tuple[float, str, Committed] | None:
    """The checkpoint verified longest ago, if that is `scrub_every_s` ago or more (oldest-verified first)."""
    every = state.settings.scrub_every_s
    if every <= 0 or (state.scrub is not None and now < state.scrub.deadline):
        return None
    due = [(c.verified_at, job_id, c) for job_id, job in state.jobs.items() for c in job.committed
           if c.verified_at + every <= now and c.checkpoint_id not in job.doomed and c.checkpoint_id not in job.bad]
    return min(due, key=lambda d: (d[0], d[1], d[2].checkpoint_id)) if due else None


def next_scrub(state: State, now: float) -> tuple[State, Sequence[Output]]:
    """At a tick: read back the checkpoint verified longest ago, one at a time across all jobs."""
    due = scrub_due(state, now)
    if due is None:
        return state, ()
    _, job_id, c = due
    rate = state.settings.scrub_mb_s * 1e6
    scrub = Scrub(job_id=job_id, checkpoint_id=c.checkpoint_id, deadline=now + SCRUB_SLACK_S + 2 * c.bytes / rate)
    args = ScrubArgs(job_id=job_id, checkpoint_id=c.checkpoint_id, step=c.step, manifest_sha256=c.manifest_sha256,
                     bytes_per_s=rate)
    return replace(state, scrub=scrub), (Effect(SCRUB, args),)
