"""The node's fork server (trainer/forkserver.py, services/agent/forkserver.py) as real processes: the self-check
is forked from it and its verdict stands, pass or fail; a forked child ends as `python` would have ended it (its
exit code or signal, its atexit handlers and threads, randomness of its own); a bad request is refused and the
server serves on; and the children of a killed server die with it, are recorded as killed, and the standby pool
goes on with cold standbys."""

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from flightdeck.events.nodelocal import Assignment, ForkRequest
from flightdeck.services.agent.forkserver import ForkedProc, ForkServer, ForkServerGone
from flightdeck.services.agent.inventory import Inventory, selfcheck
from flightdeck.services.agent.launch import die_with_agent, standby_env
from flightdeck.services.agent.standbys import StandbyPool
from tests.integration.test_lifecycle_services import gone

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


@contextlib.asynccontextmanager
async def warm_server(tmp_path: Path, *preload: str) -> AsyncIterator[ForkServer]:
    """A fork server as an agent starts one (its log: tmp_path/standby.log), once all its imports are in."""
    f = ForkServer(python=sys.executable, env=standby_env(), cwd=REPO, log_file=tmp_path / "standby.log",
                   preexec=die_with_agent(os.getpid()), preload=preload)
    try:
        assert await asyncio.wait_for(f.wait_ready(), 120), (tmp_path / "standby.log").read_text()
        yield f
    finally:
        await f.close()


@pytest.fixture
async def forks(tmp_path: Path) -> AsyncIterator[ForkServer]:
    async with warm_server(tmp_path) as f:
        yield f


async def run(forks: ForkServer, argv: list[str], log: Path, cwd: Path = REPO, **env: str) -> tuple[ForkedProc, int]:
    """Fork a child that becomes `argv` (its output in `log`); its pid and exit code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        proc = await forks.run(Assignment(argv=argv, env={**forks.env, **env}, cwd=str(cwd)), fd)
    finally:
        os.close(fd)
    async with asyncio.timeout(60):
        return proc, await proc.wait()


async def test_the_self_check_is_forked_from_the_fork_server_and_its_verdict_stands(forks: ForkServer) -> None:
    cpu = Inventory(kind="cpu", slots=2, devices=["cpu", "cpu"], memory_gb=0.0)
    ok = await selfcheck(sys.executable, cpu, 120, forks)
    assert ok.ok and ok.detail.startswith("devices: cpu, cpu;"), ok
    assert forks.forked == 1
    # A GPU node without the GPUs it claims (this box has none): the check fails and says why, forked all the same.
    bad = await selfcheck(sys.executable, Inventory(kind="gpu", slots=1, devices=["H100"], memory_gb=80.0), 120, forks)
    assert not bad.ok and bad.detail.startswith("exit code 1: RuntimeError: 1 slots asked for but only 0 CUDA"), bad
    assert forks.forked == 2 and forks.children == {}


async def test_a_forked_child_ends_as_python_would_end_it(forks: ForkServer, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, os, sys, threading, time\n"
        "assert 'torch' in sys.modules  # warm: the server's imports\n"
        f"mark = lambda what: open({str(marks)!r}, 'a').write(what + '\\n')\n"
        "atexit.register(mark, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), mark('thread finished'))).start()\n"
        "import random\n"
        "print('random', random.random(), flush=True)\n"
        "sys.exit(int(os.environ['RANK']) + 7)\n")
    first, code = await run(forks, [sys.executable, str(script)], tmp_path / "r0.log", cwd=tmp_path, RANK="0")
    assert code == 7 and first.returncode == 7, (tmp_path / "r0.log").read_text()
    # Its non-daemon thread was joined and its atexit handler ran, after the script's own end, as in `python`.
    assert marks.read_text().splitlines() == ["thread finished", "atexit ran"]
    second, code = await run(forks, [sys.executable, str(script)], tmp_path / "r1.log", cwd=tmp_path, RANK="1")
    assert code == 8 and second.pid != first.pid
    # Each child draws its own random numbers, as two processes started cold would.
    draws = [line for log in ("r0.log", "r1.log") for line in (tmp_path / log).read_text().splitlines()
             if line.startswith("random ")]
    assert len(draws) == 2 and draws[0] != draws[1], draws
    # An uncaught exception: exit 1, and its traceback starts at the script, as a cold `python train.py` prints it
    # (the fork server's, the standby's and runpy's frames above it are not shown).
    failing = tmp_path / "fail.py"
    failing.write_text("def boom():\n    raise RuntimeError('boom')\n\nboom()\n")
    _, code = await run(forks, [sys.executable, str(failing)], tmp_path / "fail.log", cwd=tmp_path)
    shown = (tmp_path / "fail.log").read_text().splitlines()
    assert code == 1 and shown == ["Traceback (most recent call last):",
                                   f'  File "{failing}", line 4, in <module>', "    boom()",
                                   f'  File "{failing}", line 2, in boom', "    raise RuntimeError('boom')",
                                   "RuntimeError: boom"], shown
    # An uncaught KeyboardInterrupt: dead of SIGINT after its traceback, as Python 3.8+ ends then.
    interrupted = tmp_path / "interrupted.py"
    interrupted.write_text("raise KeyboardInterrupt\n")
    _, code = await run(forks, [sys.executable, str(interrupted)], tmp_path / "int.log", cwd=tmp_path)
    assert code == -signal.SIGINT and "KeyboardInterrupt" in (tmp_path / "int.log").read_text()
    # Killed by a signal: -N, as asyncio reports a process it started.
    _, code = await run(forks, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                        tmp_path / "term.log")
    assert code == -signal.SIGTERM
    assert forks.children == {}


async def test_a_bad_request_is_refused_and_the_server_serves_on(forks: ForkServer, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "x.log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(ForkServerGone, match="1 descriptors attached, 2 expected"):
            await forks._fork(ForkRequest(), [fd], complete=True)  # a standby needs its log and its socket
    finally:
        os.close(fd)
    _, code = await run(forks, [sys.executable, "-c", "pass"], tmp_path / "ok.log")
    assert code == 0 and forks.forked == 1


PROBE = "tests.fixtures.preload_probe"


async def test_preloaded_modules_are_imported_once_for_every_child_and_a_missing_one_costs_only_itself(
        tmp_path: Path) -> None:
    async with warm_server(tmp_path, PROBE, "no_such_module_for_flightdeck") as f:
        check = tmp_path / "check.py"  # a script runs warm (`python -c` would be started cold)
        check.write_text(f"import sys\nsys.exit(0 if {PROBE!r} in sys.modules else 3)\n")
        for n in range(2):
            _, code = await run(f, [sys.executable, str(check)], tmp_path / f"r{n}.log")
            assert code == 0, (tmp_path / f"r{n}.log").read_text()
            assert "preload probe imported" not in (tmp_path / f"r{n}.log").read_text()  # found, not imported again
        server_log = (tmp_path / "standby.log").read_text()
        assert server_log.count("preload probe imported") == 1, server_log
        assert "No module named 'no_such_module_for_flightdeck'" in server_log  # said, and the server went on
        assert f.forked == 2


async def test_the_children_of_a_killed_fork_server_die_with_it_and_the_pool_goes_on_cold(tmp_path: Path) -> None:
    log = tmp_path / "standby.log"
    forks = ForkServer(python=sys.executable, env=standby_env(), cwd=REPO, log_file=log,
                       preexec=die_with_agent(os.getpid()))
    pool = StandbyPool(size=1, python=sys.executable, env=standby_env(), cwd=REPO, log_file=log,
                       preexec=die_with_agent(os.getpid()), producer="test", refill_delay_s=0.0, forks=forks)
    try:
        pool.start()
        assert await asyncio.wait_for(forks.wait_ready(), 120), log.read_text()
        sleeper = await asyncio.wait_for(_sleeper(forks, tmp_path), 60)
        await until(lambda: bool(pool.idle and pool.idle[0].ready), 60, "a forked standby")
        idle = pool.idle[0]
        assert isinstance(idle.proc, ForkedProc)
        assert forks.proc is not None
        os.killpg(forks.proc.pid, signal.SIGKILL)
        async with asyncio.timeout(60):
            assert await sleeper.wait() == -signal.SIGKILL
            assert await idle.proc.wait() == -signal.SIGKILL
        assert gone(sleeper.pid) and gone(idle.proc.pid) and forks.gone
        with pytest.raises(ForkServerGone):
            await forks.run(Assignment(argv=[sys.executable, "-c", "pass"], env=forks.env, cwd=str(REPO)), 1)
        # The pool replaces its dead standby with one started cold (the agent's own child).
        await until(lambda: bool(pool.idle and pool.idle[0].ready and pool.idle[0] is not idle), 120, "a cold one")
        assert isinstance(pool.idle[0].proc, asyncio.subprocess.Process)
    finally:
        await pool.close()
        await forks.close()


async def until(done: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"no {what} in {within:g}s"
        await asyncio.sleep(0.05)


async def _sleeper(forks: ForkServer, tmp_path: Path) -> ForkedProc:
    """A forked child that would run for two minutes."""
    fd = os.open(tmp_path / "sleeper.log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        proc = await forks.run(Assignment(argv=[sys.executable, "-c", "import time; time.sleep(120)"], env=forks.env,
                                          cwd=str(REPO)), fd)
    finally:
        os.close(fd)
    return proc
