"""The real-process nemesis (Jepsen's way): seeded random schedules of SIGKILL, SIGSTOP and SIGTERM against the broker
(restarted on the same store), each service, the node agent and the ranks, while a real job trains on the real
broker. After each schedule the job must have ended completed, `flightdeck verify` must re-derive every recorded
decision, and no step or decision may be lost or doubled (tests/chaos/checks.py). Each schedule prints its seed;
`FLIGHTDECK_NEMESIS_SEED=N pytest tests/nemesis` runs that one again. `make soak` runs more of them."""

import asyncio
import os
import random
import shutil
import signal
from collections.abc import Callable

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointFailed, CheckpointsFailing
from flightdeck.events.fleet import NodeCordoned, NodeLost, NodeUncordoned
from flightdeck.events.job import WorkersStarted
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell.objects.local import TMP
from tests.chaos.harness import (
    CHECKPOINT_EVERY,
    PACE_S,
    Chaos,
    chaos_spec,
    ended,
    rank_pids,
    restart,
    sigkill,
    step_reached,
)
from tests.e2e.drill_harness import wait_lineage
from tests.integration.lifecycle_harness import SERVICES, Platform
from tests.integration.test_lifecycle_services import Cluster

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
STEPS = 150
NUM = int(os.environ.get("FLIGHTDECK_NEMESIS_SCHEDULES", "2"))
FIRST = int(os.environ.get("FLIGHTDECK_NEMESIS_SEED", "1"))
MOVES_V1 = ("kill_broker", "pause_broker", "kill_service", "stop_service", "term_rank", "kill_rank", "kill_agent")
# pause_agent: the node agent frozen past the lost deadline (SIGSTOP, a swap or I/O stall), then resumed: its node is
# declared lost, and it must fence its ranks and join again for the job to go on (issue 51). In a CI run of seed 1 the
# frozen agent's ranks trained steps 70-89 unseen, the set it persisted of them after the rejoin's fence committed,
# and the job's lineage lacked their reports: a lost node's late writes are refused now (checkpoints Settings.fence).
# refuse_writes: the object store refuses every write (a full or read-only store) for three checkpoints' time and
# more, reads still served: the job trains on with the risk named (CheckpointsFailing), and recovers (issue 51).
# blind_agent: the node agent SIGKILLed and started on a store location that holds nothing of the platform's (a
# missing mount, wrong credentials) until its node is cordoned for it or a while has passed, then started right: no
# checkpoint may be deleted on its word, and the node must come back (issue 51).
MOVES = (*MOVES_V1, "pause_agent", "refuse_writes", "blind_agent")
LOST_S = 0.5 * 8  # the chaos spec's heartbeats: every 0.5 s, lost after 8 missed


def schedule(seed: int, moves: tuple[str, ...] = MOVES) -> list[tuple[str, str, float]]:
    """(move, target, seconds) x 3, drawn from the seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        move = rng.choice(moves)
        target = rng.choice(SERVICES) if move in ("kill_service", "stop_service") else str(rng.randrange(2))
        out.append((move, target, round(rng.uniform(0.5, 3.0), 1)))
    return out


def steps_seen(p: Platform, job_id: str) -> int:
    return len(p.seen(StepCompleted, job_id, stream=subjects.TELEMETRY))


def attempt_of(p: Platform, job_id: str) -> int:
    return max((e.attempt for e in p.seen(WorkersStarted, job_id)), default=0)


async def apply(c: Chaos, job_id: str, move: str, target: str, seconds: float) -> str:
    p = c.platform
    match move:
        case "kill_broker":
            await c.kill_broker(down_s=seconds)
            return f"SIGKILL nats-server, down {seconds:g} s, restarted on its store"
        case "pause_broker":
            await c.pause_broker(seconds)
            return f"SIGSTOP nats-server {seconds:g} s"
        case "kill_service":
            await sigkill(p, target)
            await asyncio.sleep(seconds)
            await restart(p, target)
            return f"SIGKILL {target}, restarted {seconds:g} s later"
        case "stop_service":
            pid = p.procs[target].pid
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(seconds)
            os.kill(pid, signal.SIGCONT)
            return f"SIGSTOP {target} {seconds:g} s"
        case "term_rank" | "kill_rank":
            pids = rank_pids(p, job_id, attempt_of(p, job_id))
            pid = pids.get(int(target))
            if pid is not None:
                os.kill(pid, signal.SIGTERM if move == "term_rank" else signal.SIGKILL)
            return f"{'SIGTERM' if move == 'term_rank' else 'SIGKILL'} rank {target} from outside the platform"
        case "pause_agent":
            pid, lost = p.procs["agent-n1"].pid, len([e for e in p.seen(NodeLost) if e.node == "n1"])
            back = len([e for e in p.seen(NodeUncordoned) if e.node == "n1"])
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(LOST_S + 2 + seconds)
            os.kill(pid, signal.SIGCONT)
            if len([e for e in p.seen(NodeLost) if e.node == "n1"]) == lost:
                return f"SIGSTOP the node agent {LOST_S + 2 + seconds:g} s (its node was not found lost meanwhile)"
            await p.until(lambda: len([e for e in p.seen(NodeUncordoned) if e.node == "n1"]) > back, 60,
                          "the frozen agent to join again", job_id)
            return f"SIGSTOP the node agent {LOST_S + 2 + seconds:g} s: its node found lost, and back"
        case "refuse_writes":
            refusing = 3 * CHECKPOINT_EVERY * PACE_S + seconds  # three checkpoints fail at least: an incident
            tmp = p.root / "objects" / TMP  # where the local store writes before it renames: a file, so writes fail
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.write_text("the nemesis: this store refuses writes")
            failed, incidents = len(p.seen(CheckpointFailed, job_id)), len(p.seen(CheckpointsFailing, job_id))
            try:
                await asyncio.sleep(refusing)
            finally:
                tmp.unlink()
                tmp.mkdir()
            return (f"the object store refused every write for {refusing:g} s (reads served): "
                    f"{len(p.seen(CheckpointFailed, job_id)) - failed} checkpoints failed, "
                    f"{len(p.seen(CheckpointsFailing, job_id)) - incidents} incident(s)")
        case "blind_agent":
            await sigkill(p, "agent-n1")
            elsewhere = p.root / f"elsewhere-{len(p.control)}"
            elsewhere.mkdir()
            cordons = len([e for e in p.seen(NodeCordoned) if e.node == "n1"])
            Cluster.agent(p, "n1", "--objects", str(elsewhere), "--grace-s", "2")
            blinded = await _within(lambda: len([e for e in p.seen(NodeCordoned) if e.node == "n1"]) > cordons,
                                    LOST_S + 2 + seconds)
            await sigkill(p, "agent-n1")
            back = len([e for e in p.seen(NodeUncordoned) if e.node == "n1"])
            p.agent("n1", "--grace-s", "2")
            if blinded:
                await p.until(lambda: len([e for e in p.seen(NodeUncordoned) if e.node == "n1"]) > back, 60,
                              "the node, started right, to be uncordoned", job_id)
            return (f"the node agent restarted blind to the store, "
                    f"{'its node cordoned for it' if blinded else 'not found blind'}, then restarted right")
        case "kill_agent":
            await sigkill(p, "agent-n1")
            await asyncio.sleep(seconds)
            p.agent("n1", "--grace-s", "2")
            return f"SIGKILL the node agent with its ranks, restarted {seconds:g} s later"
    raise AssertionError(move)


async def _within(check: Callable[[], bool], seconds: float) -> bool:
    """Whether `check` holds within `seconds` (polled)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", range(FIRST, FIRST + NUM))
async def test_a_seeded_schedule_of_process_faults(chaos: Chaos, seed: int) -> None:
    c, job = chaos, f"nemesis-{seed:06d}"
    p = c.platform
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    await p.submit(chaos_spec("nemesis", STEPS, paced_attempts=6, heartbeat_misses=8, max_restarts=8), job)
    plan = schedule(seed)
    print(f"\nnemesis seed {seed}: {plan} (FLIGHTDECK_NEMESIS_SEED={seed} replays it)")
    done: list[str] = []
    await step_reached(p, job, 0, 3)
    for move, target, seconds in plan:
        done.append(await apply(c, job, move, target, seconds))
        before = steps_seen(p, job)
        # trains on, or ended meanwhile (a blind agent's ranks may run to the last step with every upload lost)
        await p.until(lambda before=before: steps_seen(p, job) >= before + 4 or ended(p, job), 150,
                      "the job to train again", job)
    outcome = await c.outcome(job, STEPS, f"nemesis {seed}", done)
    assert await wait_lineage(p, job, STEPS) == []
    assert outcome.held, (seed, done, outcome)
