"""Warm standby ranks (services/agent/standbys.py, trainer/standby.py) as real processes: a standby becomes
the command it is handed, warm when it can and cold in place when its environment cannot be changed after
import; one that dies idle is replaced; the next agent finds one that outlived its agent (by its log, or by its
start before its record when its output is a pipe, as an agent hands it). Through a
node agent, a rank started from a standby trains, crashes, restarts and is recorded exactly like the rank
forked beside it when the pool ran dry, and standbys and ranks die with a killed agent."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeHeartbeat
from flightdeck.events.job import JobCompleted, WorkersStarted
from flightdeck.events.spec import FaultSpec, JobSpec
from flightdeck.events.training import RankStarted, StepCompleted
from flightdeck.services.agent.forkserver import ForkedProc, ForkServer
from flightdeck.services.agent.launch import die_with_agent, standby_env
from flightdeck.services.agent.main import STANDBY_ENV, kill_if_rank, started_at
from flightdeck.services.agent.standbys import Standby, StandbyPool
from tests.integration.test_lifecycle_services import ENDLESS, TINY, Cluster, cluster, exits, gone

REPO = Path(__file__).resolve().parents[2]

__all__ = ["cluster"]  # the fixture, shared with the lifecycle tests
CRASH_EXIT_CODE = 3  # trainer/faults.py (the test does not import the trainer: it would import torch)


@pytest.fixture(params=["cold", "forked"])
async def pool(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[StandbyPool]:
    """Standbys started as processes of their own, or forked by a fork server (what an agent with standbys runs)."""
    env, log = standby_env(), tmp_path / "standby.log"
    forks = ForkServer(python=sys.executable, env=env, cwd=REPO, log_file=log, preexec=die_with_agent(os.getpid())) \
        if request.param == "forked" else None
    p = StandbyPool(size=1, python=sys.executable, env=env, cwd=REPO, log_file=log,
                    preexec=die_with_agent(os.getpid()), producer="test", refill_delay_s=0.0, forks=forks)
    try:
        yield p
    finally:
        await p.close()
        if forks is not None:
            await forks.close()


async def ready_one(p: StandbyPool, *, besides: tuple[Standby, ...] = (), within: float = 90.0) -> Standby:
    """The pool's idle standby once it is ready, waiting past those in `besides` (taken, or killed); forked when
    the pool has a fork server."""
    deadline = time.monotonic() + within
    while not (p.idle and p.idle[0].ready and p.idle[0] not in besides):
        assert time.monotonic() < deadline, "no standby became ready"
        await asyncio.sleep(0.1)
    assert isinstance(p.idle[0].proc, ForkedProc) == (p.forks is not None)
    return p.idle[0]


def hand(p: StandbyPool, log: Path, env: dict[str, str], statement: str) -> Standby:
    """Hand `python -m timeit -n 1 -r 1 STATEMENT` to the pool's ready standby, its output to `log`."""
    standby = p.take()
    assert standby is not None and standby.ready
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        assert p.assign(standby, [sys.executable, "-m", "timeit", "-n", "1", "-r", "1", statement], env, REPO, fd)
    finally:
        os.close(fd)
    return standby


async def run(p: StandbyPool, log: Path, env: dict[str, str], statement: str) -> tuple[Standby, int]:
    """`hand` it and wait for its exit code."""
    standby = hand(p, log, env, statement)
    async with asyncio.timeout(60):
        return standby, await standby.proc.wait()


@pytest.mark.timeout(240)
async def test_a_standby_runs_its_assignment_warm_or_cold_in_place_and_a_dead_one_is_replaced(
        pool: StandbyPool, tmp_path: Path) -> None:
    pool.start()
    first = await ready_one(pool)
    # Warm: torch is already imported, the rank's variables (rendezvous, its job's broker user) and log file are
    # its own, the cwd is the one asked.
    log = tmp_path / "warm.log"
    check = (f"import os, sys; assert 'torch' in sys.modules; assert os.environ['RANK'] == '5'; "
             f"assert os.environ['FLIGHTDECK_NATS_USER'] == 'job-x'; "
             f"assert os.getcwd() == {str(REPO)!r}; assert os.getpid() == {first.proc.pid}")
    standby, code = await run(pool, log, {**pool.env, "RANK": "5", "FLIGHTDECK_NATS_USER": "job-x"}, check)
    assert standby is first and code == 0, log.read_text()
    assert "1 loop" in log.read_text()
    # Idle and killed: replaced by a new process.
    second = await ready_one(pool, besides=(first,))
    os.killpg(second.proc.pid, signal.SIGKILL)
    third = await ready_one(pool, besides=(first, second))
    assert third.proc.pid not in (first.proc.pid, second.proc.pid)
    # A variable read at import (libgomp reads OMP_NUM_THREADS as torch loads) differs: exec'd cold, same pid.
    log = tmp_path / "cold.log"
    check = (f"import os, sys; assert 'torch' not in sys.modules; assert os.environ['OMP_NUM_THREADS'] == '2'; "
             f"assert os.getpid() == {third.proc.pid}")
    standby, code = await run(pool, log, {**pool.env, "OMP_NUM_THREADS": "2"}, check)
    assert standby is third and code == 0, log.read_text()
    # A rank from a standby that outlived its agent: the next agent knows it by its log (its command line is the
    # standby's) and kills it, and only it.
    fourth = await ready_one(pool, besides=(third,))
    hand(pool, tmp_path / "orphan-000001-a0-r1.log", pool.env, "import time; time.sleep(60)")
    await asyncio.sleep(0.5)
    kill_if_rank(fourth.proc.pid, "other-000001")
    await asyncio.sleep(0.5)
    assert fourth.proc.returncode is None
    kill_if_rank(fourth.proc.pid, "orphan-000001")
    async with asyncio.timeout(10):
        assert await fourth.proc.wait() == -signal.SIGKILL
    # An agent hands its ranks a pipe, not a log file: the next agent knows one by its start, before its record
    # (WorkersStarted), where a process that took its pid since started after it.
    piped = await ready_one(pool, besides=(fourth,))
    read_end, write_end = os.pipe()
    try:
        before = started_at(piped.proc.pid) - 5.0  # a record older than the process: not this rank
        assert pool.take() is piped
        sleep = [sys.executable, "-m", "timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)"]  # warm
        assert pool.assign(piped, sleep, pool.env, REPO, write_end)
        os.close(write_end)
        await asyncio.sleep(0.5)
        kill_if_rank(piped.proc.pid, "orphan-000002", before)
        await asyncio.sleep(0.5)
        assert piped.proc.returncode is None
        kill_if_rank(piped.proc.pid, "orphan-000002", time.time())
        async with asyncio.timeout(10):
            assert await piped.proc.wait() == -signal.SIGKILL
    finally:
        os.close(read_end)
    # Closing the pool kills the idle standby (a cold one still warming up, perhaps).
    deadline = time.monotonic() + 10
    while not pool.idle:
        assert time.monotonic() < deadline, "the pool did not refill"
        await asyncio.sleep(0.05)
    fifth = pool.idle[0]
    await pool.close()
    assert gone(fifth.proc.pid)


@pytest.mark.timeout(240)
async def test_an_entrypoint_script_runs_warm_as_python_would_run_it_and_its_exit_code_stands(
        pool: StandbyPool, tmp_path: Path) -> None:
    """`python train.py ...` (an entrypoint job) gets the head start too: torch already imported, the script as
    __main__ with its own argv, its directory first on sys.path (its sibling modules import), in the same pid."""
    pool.start()
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "helper.py").write_text("VALUE = 7\n")
    script = jobs / "train.py"
    script.write_text("import os, sys\nimport helper\nassert 'torch' in sys.modules\n"
                      f"assert sys.argv == [{str(script)!r}, '--lr', '3e-4'], sys.argv\n"
                      "print('script ran', helper.VALUE, os.getpid(), os.getcwd(), os.environ.get('HF_HUB_OFFLINE'), "
                      "flush=True)\n"
                      "sys.exit(int(os.environ['RANK']))\n")
    # RANK is read late (LATE_ENV): a different one still runs warm; it is the exit code here. A job's own variable
    # (entrypoint.env) keeps the warm start too: it is set before the script runs (nodelocal.acts_early).
    for rank, offline in ((0, None), (3, "1")):
        standby = await ready_one(pool)
        assert pool.take() is standby
        log = tmp_path / f"rank-{rank}.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            argv = [sys.executable, str(script), "--lr", "3e-4"]
            job_env = {"HF_HUB_OFFLINE": offline} if offline else {}
            assert pool.assign(standby, argv, {**pool.env, **job_env, "RANK": str(rank)}, tmp_path, fd)
        finally:
            os.close(fd)
        async with asyncio.timeout(60):
            code = await standby.proc.wait()
        text = log.read_text()
        assert code == rank and f"script ran 7 {standby.proc.pid} {tmp_path} {offline}" in text, text


@pytest.mark.timeout(240)
async def test_the_pool_refills_only_once_the_ranks_handed_out_got_going_or_after_the_cap(
        pool: StandbyPool, tmp_path: Path) -> None:
    """New standbys importing torch beside a restarting rank slow it on a node with few cores: the spawner holds the
    refill until its ranks' beats show a step (spawner.py), or for REFILL_HOLD_S at most."""
    pool.start()
    first = await ready_one(pool)
    hand(pool, tmp_path / "r0.log", pool.env, "import time; time.sleep(60)")
    going: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pool.refill_after(going, max_s=600)
    await asyncio.sleep(2)  # the pool's refill delay is 0: unheld, a standby would be starting by now
    assert pool.idle == [] and not pool.filling
    going.set_result(None)
    second = await ready_one(pool, besides=(first,))
    # A rank that never gets going holds the refill no longer than the cap.
    hand(pool, tmp_path / "r1.log", pool.env, "import time; time.sleep(60)")
    pool.refill_after(asyncio.get_running_loop().create_future(), max_s=0.5)
    await ready_one(pool, besides=(first, second))
    for s in (first, second):
        os.killpg(s.proc.pid, signal.SIGKILL)


def agent_log(c: Cluster, node: str = "n1") -> list[dict[str, object]]:
    rows = []
    for line in (c.root / f"agent-{node}.log").read_text().splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def handed(c: Cluster) -> dict[int, int]:
    """pid -> rank for every rank the agent handed to a standby."""
    return {int(str(r["pid"])): int(str(r["rank"])) for r in agent_log(c) if r["event"] == "rank handed to a standby"}


def forked(c: Cluster) -> dict[int, int]:
    """pid -> rank for every rank the agent forked from its fork server at once (no standby at hand)."""
    return {int(str(r["pid"])): int(str(r["rank"])) for r in agent_log(c) if r["event"] == "rank forked"}


def standbys_started(c: Cluster) -> list[int]:
    return [int(str(r["pid"])) for r in agent_log(c) if r["event"] == "standby started"]


def rank_steps(c: Cluster, job_id: str, attempt: int, rank: int) -> set[int]:
    return {e.step for e in c.seen(StepCompleted, job_id, stream=subjects.TELEMETRY)
            if e.attempt == attempt and e.rank == rank}


def standbys_reported(c: Cluster) -> list[int]:
    """n1's warm standbys, as its agent told the fleet each time they changed (NodeHeartbeat)."""
    return [e.standbys for e in c.seen(NodeHeartbeat) if e.node == "n1"]


@pytest.mark.timeout(240)
async def test_ranks_from_a_standby_and_the_fork_server_are_recorded_alike(cluster: Cluster) -> None:
    """One standby, two ranks: rank 0 starts from the standby; rank 1 finds none at hand and is forked from the
    node's fork server at once (never started cold while the server runs), side by side."""
    c = cluster
    agent = c.agent("n1", "--standby", "1")
    await c.ready()
    await c.until(lambda: any(r["event"] == "standby ready" for r in agent_log(c)), 90, "the standby to be ready")
    await c.until(lambda: standbys_reported(c)[-1:] == [1], 30, "the agent to tell the fleet of its warm standby")
    spec = JobSpec(name="warm", slots=2, model=TINY.model, train=TINY.train,
                   faults=[FaultSpec(kind="crash", step=12, rank=0)])
    job = "warm-000001"
    await c.submit(spec, job)
    await c.until(lambda: bool(c.seen(JobCompleted, job)), 150, "the job to complete", job)
    started = {e.attempt: e for e in c.seen(WorkersStarted, job)}
    assert sorted(started) == [0, 1]
    pids = dict(zip(started[0].ranks, started[0].pids, strict=True))
    assert handed(c).get(pids[0]) == 0, "attempt 0: rank 0 did not come from the standby"
    assert forked(c).get(pids[1]) == 1, "attempt 0: rank 1 was not forked from the fork server (one standby)"
    # The restart comes before the pool's refill (held until the ranks handed out get going): from the standby
    # if it is back by then, else forked. Never cold.
    pids = dict(zip(started[1].ranks, started[1].pids, strict=True))
    assert all({**handed(c), **forked(c)}.get(pid) == rank for rank, pid in pids.items()), (pids, agent_log(c))
    # Attempt 0: the standby's rank trained, then crashed with the drill's code (the forked one was killed with it).
    assert rank_steps(c, job, 0, 0) == set(range(12)) and rank_steps(c, job, 0, 1) <= set(range(12))
    assert exits(c, job, 0)[0] == CRASH_EXIT_CODE
    # Attempt 1: both resumed from the same step, trained the same steps and exited 0.
    ranks = {e.rank: e for e in c.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == 1}
    resumed = ranks[0].from_step
    assert ranks[1].from_step == resumed and ranks[0].world_size == ranks[1].world_size == 2
    await c.until(lambda: rank_steps(c, job, 1, 0) == rank_steps(c, job, 1, 1) == set(range(resumed, 20)), 60,
                  "attempt 1's steps", job)
    assert exits(c, job, 1) == {0: 0, 1: 0}
    reported = standbys_reported(c)
    assert 0 in reported[reported.index(1):]  # ready, then taken by a rank (and refilled since, perhaps)
    # its ranks gone, the idle node tells the fleet both its slots are free (it once said "free 0" until its pool
    # next changed)
    await c.until(lambda: [e.free_slots for e in c.seen(NodeHeartbeat) if e.node == "n1"][-1:] == [2], 30,
                  "the idle node's free slots")
    for rank in (0, 1):
        text = (c.data / "logs" / f"{job}-a1-r{rank}.log").read_text()
        assert "training finished" in text and "rank exiting" in text, text

    # SIGKILL the agent while a rank from a standby runs and the pool holds a fresh standby: all of them go.
    # The pool refills once the last job's ranks are gone; without a standby the rank would be forked instead.
    await c.until(lambda: standbys_reported(c)[-1:] == [1], 60, "the pool to refill after the first job")
    before = len(standbys_started(c))
    await c.submit(ENDLESS, "endless-000001")
    await c.until(lambda: len(rank_steps(c, "endless-000001", 0, 0)) >= 4, 90, "the endless job to train")
    await c.until(lambda: len(standbys_started(c)) > before, 30, "the pool to refill")
    (ev,) = c.seen(WorkersStarted, "endless-000001")
    assert handed(c).get(ev.pids[ev.ranks.index(0)]) == 0
    idle = standbys_started(c)[-1]
    (server,) = [int(str(r["pid"])) for r in agent_log(c) if r["event"] == "fork server started"]
    agent.send_signal(signal.SIGKILL)
    await c.until(lambda: all(gone(pid) for pid in [*ev.pids, idle, server]), 60,
                  "ranks, standbys and the fork server to die with the agent")
    c.agent("n1", "--standby", "0")  # the same node comes back and records them as lost, cold or warm alike
    await c.until(lambda: len(exits(c, "endless-000001", 0)) == 2, 60, "the lost ranks to be recorded")
    assert exits(c, "endless-000001", 0) == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
    await c.cancel("endless-000001")


@pytest.mark.timeout(60)
def test_a_bad_standby_count_says_what_to_change() -> None:
    base = [sys.executable, "-m", "flightdeck.services.agent", "--nats", "nats://127.0.0.1:9", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([*base, "--standby", "-1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--standby must be 0 or more" in out.stderr
    out = subprocess.run(base, cwd=REPO, env={**env, STANDBY_ENV: "two"}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "$FLIGHTDECK_STANDBY='two' is not a count of standby ranks" in out.stderr
