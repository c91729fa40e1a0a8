"""A user with two machines and a script in a folder runs `flightdeck submit job.toml` from that folder, and the
job runs on both without anything copied by hand (issue: users' code in practice). Two node agents with data
dirs of their own stand for the two machines; their working directory (the checkout) holds no train.py. Before,
`[entrypoint] cwd` was a path on the node and a copied job.toml failed until it was made absolute."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flightdeck.events.job import JobCompleted, JobFailed, JobSubmitted, WorkersExited
from flightdeck.services.shell.objects import code
from flightdeck.services.shell.objects.open import OBJECTS_ENV
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")



def tiny_script(imports: str, says: str) -> str:
    """A user's script: a linear model through the trainer API, saying `says` (a print's arguments) once."""
    return f"""\
{imports}
import torch

import flightdeck

run = flightdeck.init()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model, opt)
print({says}, flush=True)
for step in run.steps():
    loss = model(torch.ones(1, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.report(step, loss.detach())
"""


SCRIPT = tiny_script("import os\n\nfrom lib.helper import GREETING\n",
                     "f\"rank {run.rank} on {os.environ['FLIGHTDECK_NODE']} runs in {os.getcwd()}: {GREETING}, \"\n"
                     "      f\"data shipped: {os.path.exists('data/big.bin')}\"")

SPEC = """\
name = "shipped"
slots = 2
[entrypoint]
command = ["python", "train.py"]
[train]
steps = 6
checkpoint_every = 3
"""


def a_project(folder: Path) -> Path:
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "helper.py").write_text("GREETING = 'hello from the shipped helper'\n")
    (folder / "data").mkdir()
    (folder / "data" / "big.bin").write_bytes(os.urandom(4096))
    (folder / ".flightdeckignore").write_text("data/\n")
    (folder / "train.py").write_text(SCRIPT)
    (folder / "job.toml").write_text(SPEC)
    return folder


def submit(p: Platform, folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`flightdeck submit job.toml` run from `folder`, told of the platform's object store as a user would be."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), OBJECTS_ENV: p.objects.url, **p.objects.env, **env}
    return subprocess.run([*CLI, "submit", "job.toml", "--nats", p.url],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


async def test_a_job_s_folder_runs_on_two_machines_without_copying_anything(drill: Platform, tmp_path: Path) -> None:
    p = drill
    folder = a_project(tmp_path / "project")
    for node in ("n1", "n2"):
        p.agent(node, "--slots", "1", "--data-dir", str(tmp_path / node))
    await p.ready("n1")
    await p.ready("n2")
    done = submit(p, folder)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 180, "the job to end", job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))

    (submitted,) = p.seen(JobSubmitted, job)
    entry = submitted.spec.entrypoint
    assert entry is not None and entry.code.startswith("sha256:") and entry.code_bytes > 0
    digest = entry.code.removeprefix("sha256:")
    for rank, node in enumerate(("n1", "n2")):
        copy = (tmp_path / node / "code" / digest).resolve()
        assert (copy / "train.py").read_text() == SCRIPT and not (copy / "data").exists()
        said = (tmp_path / node / "logs" / f"{job}-a0-r{rank}.log").read_text()
        assert (f"rank {rank} on {node} runs in {copy}: hello from the shipped helper, data shipped: False"
                in said), said[-2000:]

    # The same folder again: the same address, stored once; a change is a new one.
    again = submit(p, folder)
    assert again.returncode == 0, again.stderr
    await p.until(lambda: bool(p.seen(JobSubmitted, again.stdout.strip())), 30, "the second submission", job)
    (second,) = p.seen(JobSubmitted, again.stdout.strip())
    assert second.spec.entrypoint is not None and second.spec.entrypoint.code == entry.code
    assert sorted(os.listdir(Path(p.objects.url) / code.PREFIX)) == [f"{digest}.tar.gz"]


async def test_code_that_cannot_be_shipped_or_run_says_why(drill: Platform, tmp_path: Path) -> None:
    p = drill
    folder = a_project(tmp_path / "project")
    (folder / ".flightdeckignore").unlink()
    over = submit(p, folder, **{code.MAX_MB_ENV: "0.001"})  # over the cap: a clear error, nothing submitted
    assert over.returncode == 2 and over.stdout == "", over.stderr
    assert "the job's code cannot be shipped" in over.stderr and "data/big.bin" in over.stderr
    assert not p.seen(JobSubmitted)

    # Shipped, then gone from the object store before a node fetched it: the job fails once, saying so.
    (folder / ".flightdeckignore").write_text("data/\n")
    done = submit(p, folder)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    await p.until(lambda: bool(p.seen(JobSubmitted, job)), 30, "the submission", job)
    for archive in (Path(p.objects.url) / code.PREFIX).iterdir():
        archive.unlink()
    p.agent("n1", "--slots", "2", "--data-dir", str(tmp_path / "n1"))
    await p.until(lambda: bool(p.seen(JobFailed, job)), 120, "the job to fail", job)
    (exit_,) = p.seen(WorkersExited, job)
    assert exit_.unrunnable and "is not in the object store" in exit_.cause
    (failed,) = p.seen(JobFailed, job)
    assert "cannot run the job's code" in failed.reason and "not restarted: the job's command cannot run" in \
        failed.reason


async def test_a_job_s_requirements_are_installed_on_the_node_and_kept(drill: Platform, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`requirements` in the spec: the agent installs them once into an environment the ranks run in, the node's
    torch and Flightdeck still theirs; the next job asking for the same gets that environment as it is."""
    from tests.integration.test_job_envs import a_wheel

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the agent's pip: everything it needs is in the shipped folder
    p = drill
    folder = tmp_path / "project"
    folder.mkdir()
    a_wheel(folder)
    (folder / "train.py").write_text(
        "import fdtestpkg, torch, flightdeck\nrun = flightdeck.init()\n"
        "print('job env says', fdtestpkg.VALUE, 'torch', torch.__version__, flush=True)\n"
        "for step in run.steps():\n    run.report(step, 1.0)\n")
    (folder / "job.toml").write_text('name = "envjob"\nslots = 1\n[entrypoint]\ncommand = ["python", "train.py"]\n'
                                     'requirements = ["./fdtestpkg-1.0-py3-none-any.whl"]\n'
                                     '[train]\nsteps = 3\ncheckpoint_every = 3\n')
    p.agent("n1", "--slots", "1")
    await p.ready("n1")
    jobs = []
    for _ in range(2):
        done = submit(p, folder)
        assert done.returncode == 0, done.stderr
        job = done.stdout.strip()
        jobs.append(job)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 180, "the job", job)  # noqa: B023
        assert p.seen(JobCompleted, job), kinds(p.job(job))
        import torch

        said = (p.data / "logs" / f"{job}-a0-r0.log").read_text()
        assert f"job env says from the job env torch {torch.__version__}" in said, said[-2000:]
    made = [line for line in (p.root / "agent-n1.log").read_text().splitlines() if "job environment made" in line]
    assert len(made) == 1, made  # the second job took the environment the first one made
