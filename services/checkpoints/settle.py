"""Handing a staged set to the uploader, and settling sets no rank left can complete (the checkpoint core's).

A set persisted from memory that a newer one of its attempt supersedes is parked (Settings.supersede "parked"):
it stays staged, and is handed over after all if the newer set fails (its shards could not be stored, or its ranks'
snapshots can never make it whole), so a second fault costs the steps between the two sets, not those back to the
store's newest checkpoint.
"""

from msgspec.structs import replace

from flightdeck.events.checkpoint import CheckpointFailed, checkpoint_id
from flightdeck.services.checkpoints import supersede as supersede_
from flightdeck.services.checkpoints.state import NOTHING_DUE, CommitArgs, Due, JobState, StagedRank, Staging

At = tuple[int, int, int]  # (attempt, timeline, step)


def hand_over(job: JobState, job_id: str, at: At, current: Staging, created_at: float,
              supersede: str) -> tuple[JobState, Due]:
    """The set at `at` goes to the uploader with the ranks it has (not one a newer set supersedes: supersede.py)."""
    attempt, timeline, step = at
    if supersede != "no" and supersede_.superseded(job, at, current):
        if supersede == "parked":
            return job, NOTHING_DUE  # handed over if the newer set fails (unpark)
        return replace(job, staging={k: v for k, v in job.staging.items() if k != at}, handed=job.handed | {at}), \
            NOTHING_DUE
    ranks = [current.ranks[r] for r in sorted(current.ranks)]
    args = CommitArgs(
        job_id=job_id, checkpoint_id=checkpoint_id(attempt, step, timeline), attempt=attempt,
        step=step, world_size=current.world_size, timeline=timeline, created_at=created_at, data=ranks[0].data,
        ranks=[StagedRank(rank=s.rank, node=s.node, shards=s.shards) for s in ranks],
        from_memory=ranks[0].from_memory,
    )
    final = -1 if step == job.final else job.final
    job = replace(job, staging={k: v for k, v in job.staging.items() if k != at}, handed=job.handed | {at},
                  final=final, committing={**job.committing, args.checkpoint_id: step})
    return (supersede_.drop_older(job, at) if args.from_memory and supersede != "no" else job), Due(commit=args)


def survivors(job: JobState, job_id: str, at: At, current: Staging, lost: frozenset[str],
              supersede: str) -> tuple[JobState, Due] | None:
    """A set persisted from memory that lacks only ranks whose nodes are lost (their memory went with them) or whose
    exits say their agent staged none (`staged_none`): with every survivor's state a full replica (plain data
    parallel) it commits with the ranks it has, restorable at any world size; else it can never be whole, and
    fails now rather than hold a restart up. None: wait."""
    present = set(current.ranks)
    if not present or not all(s.from_memory for s in current.ranks.values()) or current.stored != present:
        return None
    placed = job.placement.get(at[0], {})
    lost = lost | job.fenced.get(at[0], frozenset())  # lost while it ran them, though it may be back since
    missing = sorted(set(range(current.world_size)) - present)
    none = supersede_.never(job, at)
    nodes = sorted({placed.get(r, "") for r in missing if r not in none})
    if not missing or not all(n in lost for n in nodes):
        return None
    if all(s.replicated for s in current.ranks.values()):
        return hand_over(job, job_id, at, current, max(s.occurred_at for s in current.ranks.values()), supersede)
    attempt, timeline, step = at
    cid = checkpoint_id(attempt, step, timeline)
    why = [*([f"ranks {sorted(set(missing) - none)} were on lost node(s) {', '.join(nodes)}"] if nodes else []),
           *([f"ranks {sorted(set(missing) & none)} had no snapshot of it to stage"] if set(missing) & none else [])]
    failed = CheckpointFailed(job_id=job_id, step=step, checkpoint_id=cid,
                              reason=f"{cid}: {' and '.join(why)}, and the others' snapshots hold only their own "
                                     "shards of the state")
    return unpark(dropped(job, at), job_id, at[0], lost, supersede, Due(failed=failed, failed_id=cid))


def dropped(job: JobState, at: At) -> JobState:
    """The set at `at` will never commit: gone from staging, never handed over again."""
    return replace(job, staging={k: v for k, v in job.staging.items() if k != at}, handed=job.handed | {at})


def unpark(job: JobState, job_id: str, attempt: int, lost: frozenset[str], supersede: str,
           due: Due) -> tuple[JobState, Due]:
    """After a set of `attempt` failed: the newest set it had superseded that can settle now is handed over, with
    `due` (the failure)."""
    if supersede != "parked":
        return job, due
    for at, current in sorted(job.staging.items(), reverse=True):
        if at[0] != attempt or not current.ranks or not all(s.from_memory for s in current.ranks.values()):
            continue
        whole = len(current.ranks) == current.world_size and len(current.stored) == current.world_size
        settled = (hand_over(job, job_id, at, current, max(s.occurred_at for s in current.ranks.values()), supersede)
                   if whole else survivors(job, job_id, at, current, lost, supersede))
        if settled is not None and settled[1].commit is not None:
            return settled[0], replace(due, commit=settled[1].commit)
    return job, due


def settle(job: JobState, job_id: str, lost: frozenset[str], supersede: str) -> tuple[JobState, list[Due]]:
    """Each of the job's sets that no rank left can complete, settled (`survivors`); newest first when it
    supersedes the older ones from memory."""
    dues: list[Due] = []
    for at, current in sorted(job.staging.items(), reverse=supersede != "no"):
        if at not in job.staging:
            continue  # superseded meanwhile
        settled = survivors(job, job_id, at, current, lost, supersede)
        if settled is not None:
            job, due = settled
            dues.append(due)
    return job, dues
