"""A healed job trains bitwise as the uninterrupted one, through every recovery path (issue 52): the examples'
pytorch_ddp script (dropout, a shuffling StatefulDataLoader across an epoch's end, gradient accumulation) on the
platform, each job with one fault, against the same script run alone under torchrun without one:

    store      snapshots off: a crash restores the newest committed checkpoint from the store
    own        a snapshot every step: a crash restores the ranks' own newest snapshots, from memory
    boundary   a snapshot every 20th step: a hung rank, stopped, snapshots its last boundary on its way out
    replica    a snapshot every 20th step: rank 1 killed outright; rank 0's boundary snapshot stands in for it
    rollback   a loss spike rolled back past, its batches skipped: against a run alone that skips the same batches

Each step's loss is the newest report of it (the redone one), and the final state is read back from the last
committed checkpoint (tests/e2e/differential.py)."""

import json
from functools import partial
from pathlib import Path

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import InexactRestore
from flightdeck.events.job import JobCompleted, JobFailed, JobResumed
from flightdeck.events.spec import FaultSpec, JobSpec
from flightdeck.events.training import RankStarted
from tests.e2e.differential import EXAMPLES, Case, differences, example_case, on_platform, run_alone, spliced
from tests.e2e.drill_harness import DRILL_POLICY
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow]
STEPS, EVERY, FAULT_AT = 70, 10, 27  # 64 steps an epoch: the loader's second epoch begins at step 64
SPIKE_AT = 35
BASE = example_case("pytorch_ddp", STEPS, EVERY)


def healed(name: str, fault: FaultSpec, *, snapshot_every: int, **policy: object) -> Case:
    """The example with `fault` in attempt 0, paced there (0.05 s a step) so checkpoints commit before it."""
    spec = BASE.spec
    pace = FaultSpec(kind="slow", step=0, rank=0, seconds=0.05, attempt=0)
    train = msgspec.structs.replace(spec.train, snapshot_every=snapshot_every, snapshot_max_overhead=1.0)
    drill = msgspec.structs.replace(DRILL_POLICY, heartbeat_misses=12, **policy)
    return Case(name, BASE.example, msgspec.structs.replace(spec, name=name, train=train, policy=drill,
                                                            faults=[pace, fault]), BASE.ranks)


CASES = [
    healed("store", FaultSpec(kind="crash", step=FAULT_AT, rank=1), snapshot_every=0),
    healed("own", FaultSpec(kind="crash", step=FAULT_AT, rank=1), snapshot_every=1),
    healed("boundary", FaultSpec(kind="hang", step=FAULT_AT, rank=0), snapshot_every=20),
    healed("replica", FaultSpec(kind="crash", step=FAULT_AT, rank=1), snapshot_every=20),
    healed("rollback", FaultSpec(kind="loss_spike", step=SPIKE_AT, rank=0), snapshot_every=1, spike_window=10),
]


def ended(p: Platform, job: str) -> bool:
    return bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job))


def job_of(case: Case) -> str:
    return f"{case.name}-000001"


def path_taken(p: Platform, case: Case, agent_log: list[dict[str, object]]) -> str:
    """The recovery path the job took, in the words of CASES: from its record, its agent's log (a replica's restore)
    and its ranks' logs (a snapshot of the last boundary taken on the way out)."""
    job = job_of(case)
    if p.seen(RollbackRequested, job):
        return "rollback"
    resumed = p.seen(JobResumed, job)
    if not resumed:
        return "none"
    started = [e for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == resumed[0].attempt]
    where = {e.restored_from for e in started}
    if where == {"store"}:
        return "store"
    memory = [c for c in p.seen(CheckpointCommitted, job) if c.from_memory and c.step == resumed[0].from_step]
    if where != {"memory"} or not memory:
        return f"restored from {sorted(where)} at step {resumed[0].from_step}"
    if any(r.get("job_id") == job and r.get("event") == "restoring from memory" and "replica_of" in r
           for r in agent_log):
        return "replica"
    failed = resumed[0].attempt - 1
    taken = [f for f in (p.data / "logs").glob(f"{job}-a{failed}-r*.log")
             if "snapshot of the last boundary taken after a failure" in f.read_text()]
    return "boundary" if taken else "own"


def json_lines(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


@pytest.mark.timeout(900)
async def test_a_healed_job_trains_exactly_as_the_uninterrupted_one(drill: Platform, tmp_path: Path) -> None:
    p = drill
    p.agent("n1", "--slots", "6", "--standby", "0")
    await p.ready("n1")
    shipped: dict[str, JobSpec] = {}
    for batch in (CASES[:3], CASES[3:]):
        for case in batch:
            shipped[case.name] = await p.objects.ship(case.spec, EXAMPLES / case.example)
            await p.submit(shipped[case.name], job_of(case))
        for case in batch:
            await p.until(partial(ended, p, job_of(case)), 400, f"{case.name}'s end", job_of(case))
            assert p.seen(JobCompleted, job_of(case)), kinds(p.job(job_of(case)))
    alone = run_alone(tmp_path / "alone", BASE)
    agent_log = json_lines(tmp_path / "agent-n1.log")
    parted, paths = {}, {}
    for case in CASES:
        job = job_of(case)
        paths[case.name] = path_taken(p, case, agent_log)
        want = alone
        if case.name == "rollback":
            (rollback,) = p.seen(RollbackRequested, job)
            skipped = run_alone(tmp_path / "skipped", BASE, restore=tmp_path / "alone" / ".flightdeck" / "staging" /
                                "local" / f"step-{rollback.to_step}", skips=(rollback.skip_from, rollback.skip_to))
            want = spliced(alone, skipped, rollback.to_step)
        found = differences(want, on_platform(p, job, case))
        if found:
            parted[case.name] = found
    # Exact in each, and said so: only the replica's rank 1 took an extra (its loader's position) from rank 0's copy,
    # which the record says may part from the uninterrupted run (here it did not: the ranks' positions are alike).
    said = {c.name: [f.reason for f in p.seen(InexactRestore, job_of(c))] for c in CASES}
    assert said["replica"] and "flightdeck_loader (rank 0's)" in said["replica"][0], said
    assert (paths, parted, {k: v for k, v in said.items() if v and k != "replica"}) == \
        ({c.name: c.name for c in CASES}, {}, {})
