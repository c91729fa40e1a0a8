"""Sets persisted from memory that a newer one of their attempt supersedes (Settings.supersede).

A node agent stages each gone rank's complete slots newest first, often two (a peer's newest may be one step
behind), and a rank that snapshots its last boundary after a failure (trainer/lastboundary.py) leaves one newer than
its cadence's. Every set the ranks complete would commit, in whichever order their uploads finish, and the first
from-memory commit ends the restart's wait (scheduler/commit_wait.py): an older one landing first made the restart
redo the steps between (bench/vs_peers.py: 40 restored where 47 was staged). So the newest wins: a set is not handed
over while a newer one of its attempt holds every rank it holds, and handing one over drops the older ones.
"""

from msgspec.structs import replace

from flightdeck.services.checkpoints.state import JobState, Staging

At = tuple[int, int, int]  # (attempt, timeline, step): a rollback's newer timeline is newer at any step


def _from_memory(s: Staging) -> bool:
    return all(r.from_memory for r in s.ranks.values())


def never(job: JobState, at: At) -> frozenset[int]:
    """Ranks of `at`'s attempt that can never join the set at `at`: their exits say their agent staged no snapshot,
    or only older ones (it stages all it has before it records the exit)."""
    upto = job.staged_upto.get(at[0], {})
    return job.staged_none.get(at[0], frozenset()) | {r for r, newest in upto.items() if newest < at[1:]}


def superseded(job: JobState, at: At, current: Staging) -> bool:
    """Whether a newer set of `at`'s attempt from memory will settle as soon as this one could, and is the one to
    restore: it holds every rank `current` holds but those that can never join it, and lacking any, each of its
    ranks holds a full replica (core `_survivors` then commits it without them)."""
    if not _from_memory(current):
        return False
    for k, v in job.staging.items():
        if k[0] != at[0] or k[1:] <= at[1:] or not v.ranks or not _from_memory(v):
            continue
        lacking = set(current.ranks) - set(v.ranks)
        if lacking <= never(job, k) and (not lacking or all(r.replicated for r in v.ranks.values())):
            return True
    return False


def drop_older(job: JobState, at: At) -> JobState:
    """`at`, from memory, was handed over: its attempt's older sets from memory go (never handed over)."""
    older = {k for k, v in job.staging.items() if k[0] == at[0] and k[1:] < at[1:] and _from_memory(v)}
    newest = max(at[1:], job.memory_handed.get(at[0], (-1, -1)))
    return replace(job, staging={k: v for k, v in job.staging.items() if k not in older}, handed=job.handed | older,
                   memory_handed={a: v for a, v in {**job.memory_handed, at[0]: newest}.items() if a >= job.attempt})
