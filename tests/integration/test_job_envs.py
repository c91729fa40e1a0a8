"""A job's own packages on a node (services/agent/envs.py): installed once into an environment made from the job's
Python that still sees the node's torch and Flightdeck, kept for the next attempt and any job with the same list;
a requirement that cannot be installed is one clear error, and leaves nothing half made."""

import asyncio
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from flightdeck.events.spec import EntrypointSpec
from flightdeck.services.agent.envs import EnvCache, EnvError, interpreter

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
