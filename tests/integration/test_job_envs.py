"""A job's own packages on a node (services/agent/envs.py): installed once into an environment made from the job's
Python that still sees the node's torch and Flightdeck, kept for the next attempt and any job with the same list;
a requirement that cannot be installed is one clear error, and leaves nothing half made."""

import asyncio
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flightdeck.events.spec import EntrypointSpec
from flightdeck.services.agent.envs import EnvCache, EnvError, interpreter
from flightdeck.services.agent.launch import die_with_agent, standby_env
from flightdeck.services.agent.standbys import ENV_SERVERS, StandbyPool

pytestmark = pytest.mark.timeout(300)


def a_wheel(folder: Path, name: str = "fdtestpkg", value: str = "from the job env") -> Path:
    """A pure-Python wheel (built by hand: no index, no build backend needed)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VALUE = {value!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in (f"{name}/__init__.py", f"{info}/METADATA",
                                                                   f"{info}/WHEEL", f"{info}/RECORD")))
    return path


async def test_requirements_are_installed_once_beside_the_node_s_torch(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # everything it needs is local
    code = tmp_path / "code"
    code.mkdir()
    a_wheel(code)
    entry = EntrypointSpec(command=["python", "train.py"], requirements=["./fdtestpkg-1.0-py3-none-any.whl"])
    cache = EnvCache(root=tmp_path / "node")
    assert await cache.python(EntrypointSpec(command=["python"]), code) is None  # nothing asked: the node's own
    python = await cache.python(entry, code)
    assert python is not None and Path(python).parent.parent.parent == tmp_path / "node" / "envs"
    import torch

    ran = await asyncio.to_thread(subprocess.run, [python, "-c", "import fdtestpkg, torch; "
                                                   "print(fdtestpkg.VALUE, torch.__version__)"],
                                  capture_output=True, text=True, timeout=120)
    assert ran.stdout.split() == ["from", "the", "job", "env", torch.__version__], ran.stderr
    marker = Path(python).parent.parent / "kept"
    marker.touch()
    assert await cache.python(entry, code) == python and marker.exists()  # kept, not made again
    assert await EnvCache(root=tmp_path / "node").python(entry, code) == python  # by the next agent too

    bad = EntrypointSpec(command=["python"], requirements=["./no-such-1.0-py3-none-any.whl"])
    with pytest.raises(EnvError) as err:
        await cache.python(bad, code)
    assert "installing its requirements failed" in str(err.value) and "no-such" in err.value.error
    assert sorted(p.name for p in (tmp_path / "node" / "envs").iterdir()) == [Path(python).parent.parent.name]


async def test_the_job_s_own_interpreter_is_used_as_named(tmp_path: Path) -> None:
    assert interpreter(EntrypointSpec(command=["python"], python=sys.executable)) == sys.executable
    venv = tmp_path / "venv"
    await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                            timeout=120)
    assert interpreter(EntrypointSpec(command=["python"], python=str(venv))) == str(venv / "bin" / "python")
    cache = EnvCache(root=tmp_path / "node")
    assert await cache.python(EntrypointSpec(command=["python"], python=str(venv)), None) == str(venv / "bin/python")
    with pytest.raises(EnvError, match="is not an interpreter on this node"):
        await cache.python(EntrypointSpec(command=["python"], python=str(tmp_path / "nope")), None)


async def test_a_job_s_interpreter_gets_a_fork_server_of_its_own_so_its_ranks_start_warm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job with its own packages kept its warm starts: its ranks are forked from a server running its
    environment's Python, torch already imported, with its packages importable; a command that is no job's Python
    starts cold, and the least recently used server with no ranks makes room for a third environment."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    code = tmp_path / "code"
    code.mkdir()
    a_wheel(code)
    python = await EnvCache(root=tmp_path / "node").python(
        EntrypointSpec(command=["python", "train.py"], requirements=["./fdtestpkg-1.0-py3-none-any.whl"]), code)
    assert python is not None
    (code / "train.py").write_text("import sys\nwarm = 'torch' in sys.modules\nimport fdtestpkg\n"
                                   "print('ran', sys.executable, warm, fdtestpkg.VALUE, flush=True)\n")
    pool = StandbyPool(size=0, python=sys.executable, env=standby_env(), cwd=tmp_path, log_file=tmp_path / "sb.log",
                       preexec=die_with_agent(os.getpid()), producer="agent-test")
    try:
        pool.environment(python)
        log = tmp_path / "rank.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = await pool.warm_start([python, "train.py"], {**pool.env, "RANK": "0"}, code, fd, rank=0)
            assert await pool.warm_start(["/bin/true"], dict(pool.env), code, fd, rank=1) is None  # cold
        finally:
            os.close(fd)
        assert proc is not None
        async with asyncio.timeout(60):
            assert await proc.wait() == 0, log.read_text()
        assert f"ran {python} True from the job env" in log.read_text()
        assert (tmp_path / f"forkserver-{hashlib.sha256(python.encode()).hexdigest()[:12]}.log").exists()

        for other in ("/nonexistent/a/bin/python", "/nonexistent/b/bin/python"):
            pool.environment(other)  # never starts (no such file): it still holds a place
        assert list(pool.env_forks) == ["/nonexistent/a/bin/python", "/nonexistent/b/bin/python"][-ENV_SERVERS:]
    finally:
        await pool.close()
    assert pool.env_forks == {}
