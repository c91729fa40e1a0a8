"""A node that cannot read the object store is the suspect, never the checkpoints (issue 51, case 1).

Tried on 6ade4e9: a second agent whose store location was wrong (as with a missing mount or broken S3 credentials)
got the restart, rejected checkpoints 175, 150 and 125 in turn ("no manifest"), each was deleted from the real
store on its word, and the job failed with "no good checkpoint is left to restore"; the node was never cordoned.

Here n2's agent is told of an empty folder for a store. The operator cordons n1 and rank 1 is killed, so the
restart goes to n2, which cannot find step 30's manifest. Its claim deletes nothing: the checkpoint service reads
step 30 back itself, finds it intact, and the resource manager cordons n2 naming the checkpoint and n2's error.
Once the operator uncordons n1 the job restores step 30 there and completes, with every commit kept but what
retention ages out."""

import os
import signal
import time
from pathlib import Path

import pytest
from msgspec.structs import replace

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointRejected, CheckpointScrubbed
from flightdeck.events.fleet import NodeCordoned, NodeUncordoned
from flightdeck.events.job import AllocationReleased, JobCompleted, JobFailed
from flightdeck.events.training import RankStarted
from flightdeck.services.checkpoints.core import checkpoint_id
from flightdeck.services.resources.core import BLIND_CORDON
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.audit.settle import verify_live
from tests.integration.lifecycle_harness import Objects, Platform, objects, open_platform
from tests.integration.s3_fixture import moto_s3
from tests.integration.test_checkpoint_fallback import hold_after_three_commits
from tests.integration.test_lifecycle_services import Cluster, kinds

__all__ = ["moto_s3", "objects"]  # fixtures


async def operator(p: Platform, event: NodeCordoned | NodeUncordoned) -> None:
    """What `flightdeck` appends for a person who cordons or uncordons a node by hand."""
    n = len(p.control)
    await p.store.append(subjects.node(event.node, type(event).__name__),
                         replace(event, event_id=f"console-{event.node}-{n}", occurred_at=time.time(),
                                 producer="console"))


@pytest.mark.timeout(300)
async def test_a_node_blind_to_the_store_is_cordoned_and_no_checkpoint_is_deleted_on_its_word(
        nats_server: broker_mod.Broker, tmp_path: Path, objects: Objects) -> None:
    job = "blind-000001"
    p = await open_platform(nats_server.url, tmp_path, objects)
    try:
        pids = await hold_after_three_commits(p, job)
        elsewhere = tmp_path / "elsewhere"  # n2's store: reachable, and holding nothing of this platform's
        elsewhere.mkdir()
        Cluster.agent(p, "n2", "--objects", str(elsewhere), "--data-dir", str(tmp_path / "n2-data"))
        await p.ready("n2")
        await operator(p, NodeCordoned(node="n1", reason="operator: maintenance"))
        await p.until(lambda: any(e.node == "n1" for e in p.seen(NodeCordoned)), 30, "n1's cordon")
        os.kill(pids[1], signal.SIGKILL)  # the crash: the restart can only go to n2

        await p.until(lambda: any(e.node == "n2" for e in p.seen(NodeCordoned)), 120, "n2 to be cordoned", job)
        (rejected,) = p.seen(CheckpointRejected, job)
        assert (rejected.node, rejected.step) == ("n2", 30) and "manifest" in rejected.cause, rejected
        (read,) = [e for e in p.seen(CheckpointScrubbed, job) if e.claim_node]
        assert (read.checkpoint_id, read.claim_node, read.cause) == (checkpoint_id(0, 30), "n2", "")
        (cordon,) = [e for e in p.seen(NodeCordoned) if e.node == "n2"]
        assert cordon.reason.startswith(BLIND_CORDON) and checkpoint_id(0, 30) in cordon.reason, cordon.reason
        assert not p.seen(JobFailed, job) and not p.seen(CheckpointDeleted, job)

        await operator(p, NodeUncordoned(node="n1", reason="operator: back from maintenance"))
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), kinds(p.job(job))
        started = {e.attempt: e.from_step for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)}
        assert started[0] == 0 and 1 not in started and set(started.values()) == {0, 30}, started  # n2 ran nothing
        assert [e.reason for e in p.seen(CheckpointDeleted, job)] == \
            ["retention"] * len(p.seen(CheckpointDeleted, job))  # nothing deleted on n2's word
        # steps 10-50, the last one's commit may land after the job's completion
        await p.until(lambda: len(p.seen(CheckpointCommitted, job)) == 5, 60, "the final step's commit", job)
        releases = [e.reason for e in p.seen(AllocationReleased, job)]
        assert sum("restart 1 of 3" in r for r in releases) == 1  # the crash spent one restart ...
        assert sum("without spending the restart budget" in r for r in releases) == 1  # ... n2's failed read none
        assert not any("restart 2 of 3" in r for r in releases)
        assert (await verify_live(p.store, job)).ok  # `flightdeck verify` re-derives every decision
    finally:
        await p.close()
