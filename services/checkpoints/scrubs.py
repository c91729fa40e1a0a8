"""When the checkpoint service reads a committed checkpoint back from the store (a scrub): one a node claimed bad
first (a claim is one witness; this read is the second), else the one verified longest ago across all jobs; one
at a time, at most `Settings.scrub_mb_s`. Pure functions of the service's state."""

from collections.abc import Sequence

from msgspec.structs import replace

from flightdeck.services.checkpoints.state import Claim, Committed, Scrub, ScrubArgs, State
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


def _claimed(state: State) -> tuple[State, tuple[Claim, Committed] | None]:
    """The oldest claim whose checkpoint is still live and not found bad, dropping those before it that are not."""
    claims = list(state.claims)
    while claims:
        claim = claims[0]
        job = state.jobs.get(claim.job_id)
        found = None if job is None or claim.checkpoint_id in job.doomed or claim.checkpoint_id in job.bad else \
            next((c for c in job.committed if c.checkpoint_id == claim.checkpoint_id), None)
        if found is not None:
            return replace(state, claims=tuple(claims)), (claim, found)
        claims.pop(0)
    return replace(state, claims=()), None


def claims_due(state: State, now: float) -> bool:
    """A claim waits for its read, and no scrub is in flight."""
    return bool(state.claims) and (state.scrub is None or now >= state.scrub.deadline)


def next_scrub(state: State, now: float) -> tuple[State, Sequence[Output]]:
    """At a tick: read back the checkpoint a node claimed bad, oldest claim first, else the one verified longest
    ago; one at a time across all jobs."""
    claim: Claim | None = None
    if claims_due(state, now):
        state, claimed = _claimed(state)
        if claimed is not None:
            claim, c = claimed
            job_id = claim.job_id
    if claim is None:
        due = scrub_due(state, now)
        if due is None:
            return state, ()
        _, job_id, c = due
    rate = state.settings.scrub_mb_s * 1e6
    scrub = Scrub(job_id=job_id, checkpoint_id=c.checkpoint_id, deadline=now + SCRUB_SLACK_S + 2 * c.bytes / rate)
    args = ScrubArgs(job_id=job_id, checkpoint_id=c.checkpoint_id, step=c.step, manifest_sha256=c.manifest_sha256,
                     bytes_per_s=rate, claim_node=claim.node if claim else "", claim_cause=claim.cause if claim else "")
    return replace(state, scrub=scrub), (Effect(SCRUB, args),)


def add_claim(state: State, claim: Claim) -> State:
    """Queue a node's claim for a read, once per checkpoint: one read answers every node's claim of it."""
    if any((c.job_id, c.checkpoint_id) == (claim.job_id, claim.checkpoint_id) for c in state.claims):
        return state
    return replace(state, claims=(*state.claims, claim))


def answered(state: State, job_id: str, checkpoint_id: str) -> State:
    """A read asked by a claim came back: the claims of that checkpoint are answered."""
    return replace(state, claims=tuple(c for c in state.claims if (c.job_id, c.checkpoint_id) != (job_id,
                                                                                                  checkpoint_id)))
