"""A job's own Python on a node (spec `entrypoint.python`, `entrypoint.requirements`): the interpreter its ranks run
as "python", and the packages it needs beyond the node's, installed once per node into a virtual environment kept
for every job that asks for the same ones.

The environment is made from the job's Python (else the node's) and sees the node's packages after its own (a
`.pth` file adding the node's site-packages), so torch and Flightdeck stay the node's: pip finds them installed
and a constraint pins torch to the node's version. It is built in a temporary folder renamed into place, so one
that exists is whole; a requirement given as a path (`./vendored`) is read from the job's shipped code.
"""

import asyncio
import hashlib
import json
import os
import shutil
import site
import sys
import time
from importlib import metadata
from pathlib import Path

import structlog

from flightdeck.events.spec import EntrypointSpec

log = structlog.get_logger("flightdeck.agent")

PIP_TIMEOUT_S = 900.0


class EnvError(Exception):
    """An environment that could not be made; `error` is its one line, the message the whole story."""

    def __init__(self, message: str, error: str) -> None:
        super().__init__(message)
        self.error = error


def interpreter(entry: EntrypointSpec, node: str = sys.executable) -> str:
    """The job's own interpreter: `entrypoint.python` (an interpreter, or a virtual environment's folder), else
    the node's (`node`)."""
    if not entry.python:
        return node
    given = Path(entry.python)
    return str(given / "bin" / "python") if given.is_dir() else str(given)


class EnvCache:
    def __init__(self, *, root: Path) -> None:
        self.root = root / "envs"
        self._locks: dict[str, asyncio.Lock] = {}
        for leftover in self.root.glob(".tmp-*") if self.root.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)

    async def python(self, entry: EntrypointSpec, code_dir: Path | None, node: str = sys.executable) -> str | None:
        """The interpreter the job's ranks run as "python": None for the node's own (`node`), the job's own, or a
        kept environment with its requirements installed (made now if this node has none yet). EnvError if it
        cannot be."""
        if not entry.python and not entry.requirements:
            return None
        base = interpreter(entry, node)
        if not os.access(base, os.X_OK):
            raise EnvError(f"entrypoint.python {entry.python!r} is not an interpreter on this node",
                           f"no interpreter at {base}")
        if not entry.requirements:
            return base
        key = self.key(base, entry.requirements, code_dir)
        dest = self.root / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if (dest / "bin" / "python").exists():
                os.utime(dest)
                return str(dest / "bin" / "python")
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".tmp-{key}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            started = time.monotonic()
            try:
                await self._make(base, tmp, entry.requirements, code_dir)
                # Renamed whole into place: its interpreter finds its prefix from where it is (pyvenv.cfg); only
                # console scripts installed into it name the temporary path, and ranks run "python" itself.
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("job environment made", path=str(dest), requirements=entry.requirements,
                     took_s=round(time.monotonic() - started, 1))
        return str(dest / "bin" / "python")

    @staticmethod
    def key(base: str, requirements: list[str], code_dir: Path | None) -> str:
        """What an environment is made of: its interpreter, the node's packages, the requirements in order, and
        the shipped code a requirement's path is read from."""
        parts = {"layout": 2, "python": os.path.realpath(base), "node": _node_sites(), "torch": _torch_version(),
                 "requirements": requirements, "code": str(code_dir) if any(_is_path(r) for r in requirements) else ""}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]

    async def _make(self, base: str, where: Path, requirements: list[str], code_dir: Path | None) -> None:
        await _run([base, "-m", "venv", "--without-pip", str(where)], None, "making its venv")
        py = where / "bin" / "python"
        sites = json.loads((await _run([str(py), "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
                                       None, "finding its site-packages")).strip())
        # addsitedir, not a bare path: the node's own .pth files run too (an editable Flightdeck is one)
        (Path(sites[0]) / "flightdeck-node.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n"
                                                                    for d in _node_sites()))
        pins = where / "node-constraints.txt"
        pins.write_text(f"torch=={_torch_version()}\n" if _torch_version() else "")
        # the node's pip installs into it (`--python`): no copy of pip in every environment
        await _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-input",
                    "--disable-pip-version-check", "-q", "-c", str(pins), *requirements], code_dir,
                   "installing its requirements")


def _node_sites() -> list[str]:
    """This node's site-packages (where torch and Flightdeck's dependencies are)."""
    return [d for d in site.getsitepackages() if os.path.isdir(d)]


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def _is_path(requirement: str) -> bool:
    return requirement.startswith((".", "/")) or requirement.endswith(".whl")


async def _run(argv: list[str], cwd: Path | None, doing: str) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(PIP_TIMEOUT_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise EnvError(f"the job's environment: {doing} took over {PIP_TIMEOUT_S:.0f}s", f"{doing}: timed out") \
            from None
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        error = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise EnvError(f"the job's environment: {doing} failed (exit {proc.returncode}): {text.strip()[-1500:]}",
                       error.strip()[:500])
    return text
