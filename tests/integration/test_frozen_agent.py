"""An agent frozen past the lost deadline and resumed joins again (issue 51, case 2).

Tried on 6ade4e9: `kill -STOP` of a node agent for 20 s, then `kill -CONT`: the node was declared lost after 5 s
and cordoned, rightly, but the agent never registered again, the cordon stayed, and the job sat in `recovering`
with no free slot for 10 minutes, until the agent was killed by hand.

Here the only node's agent is frozen while rank 0 is held in step 31 (steps 10, 20 and 30 committed) for three
times the lost deadline. The node is declared lost and the job's restart waits for slots; once the agent resumes
it finds its own NodeLost, kills the ranks it ran (their attempt was replaced), passes its self-check and
registers again; the loss cordon is lifted and the job restores step 30 on the same node and completes."""

import asyncio
import os
import signal
from pathlib import Path

import pytest
from msgspec.structs import replace

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeLost, NodeRegistered, NodeUncordoned, SelfCheckPassed
from flightdeck.events.job import JobCompleted, JobFailed
from flightdeck.events.training import RankStarted
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.audit.settle import verify_live
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform
from tests.integration.test_checkpoint_fallback import SPEC, hold_after_three_commits
from tests.integration.test_lifecycle_services import kinds

__all__ = ["local_objects"]  # fixtures

# Beats every 0.5 s, lost after 4 missed: 2 s. Rank 0 is held in step 31 (SPEC's `slow` fault, attempt 0 only).
FROZEN_SPEC = replace(SPEC, name="frozen", policy=replace(SPEC.policy, heartbeat_interval_s=0.5, heartbeat_misses=4))
FREEZE_S = 6.0
FLEET = (NodeRegistered, SelfCheckPassed, NodeLost, NodeUncordoned)


@pytest.mark.timeout(240)
async def test_an_agent_frozen_past_the_lost_deadline_fences_its_ranks_and_joins_again(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    job = "frozen-000001"
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        pids = await hold_after_three_commits(p, job, FROZEN_SPEC)
        agent = p.procs["agent-n1"].pid
        os.kill(agent, signal.SIGSTOP)
        try:
            await p.until(lambda: any(e.node == "n1" for e in p.seen(NodeLost)), 60, "n1 to be declared lost", job)
            await asyncio.sleep(FREEZE_S)
        finally:
            os.kill(agent, signal.SIGCONT)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), kinds(p.job(job))

        fleet = [s.stored.event for s in p.control if isinstance(s.stored.event, FLEET)
                 and s.stored.event.node == "n1"]
        assert [type(e).__name__ for e in fleet] == ["NodeRegistered", "SelfCheckPassed", "NodeLost",
                                                     "NodeRegistered", "SelfCheckPassed", "NodeUncordoned"]
        await p.until(lambda: not any(alive(pid) for pid in pids), 30, "attempt 0's ranks to be gone")
        started = {e.attempt: e.from_step for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)}
        assert started[0] == 0 and max(started) >= 1 and started[max(started)] == 30, started
        assert "joining again" in (tmp_path / "agent-n1.log").read_text()
        assert (await verify_live(p.store, job)).ok
    finally:
        await p.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
