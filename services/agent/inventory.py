"""What a node offers and whether it works: its slots (GPUs listed by nvidia-smi, else CPU slots; the agent
never imports torch) and the self-check it runs before registering (`python -m flightdeck.trainer.selfcheck`)."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

from flightdeck.events import subjects
from flightdeck.events.fleet import SelfCheckFailed, SelfCheckPassed
from flightdeck.events.nodelocal import Assignment
from flightdeck.services.agent.core import SelfCheckArgs
from flightdeck.services.agent.forkserver import ForkedProc, ForkServer, ForkServerGone
from flightdeck.services.core import Emit

log = structlog.get_logger("flightdeck.agent")
DEFAULT_CPU_SLOTS = 2
T = TypeVar("T")
Device = Literal["auto", "cpu", "cuda"]


class AgentError(RuntimeError):
    """A setup the agent cannot run with; the message says what to change."""


@dataclass(frozen=True)
class Inventory:
    kind: Literal["cpu", "gpu"]
    slots: int
    devices: list[str]
    memory_gb: float


def parse_gpus(text: str) -> list[tuple[str, float]]:
    """(name, memory in GB) per line of `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        name, _, mib = line.rpartition(",")
        try:
            gpus.append((name.strip(), round(float(mib) / 1024, 1)))
        except ValueError:
            gpus.append((line, 0.0))
    return gpus


def _nvidia_gpus() -> list[tuple[str, float]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_gpus(out.stdout) if out.returncode == 0 else []


def _host_memory_gb() -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def detect(device: Device, slots: int | None) -> Inventory:
    gpus = _nvidia_gpus() if device != "cpu" else []
    if device == "cuda" and not gpus:
        raise AgentError("--device cuda, but nvidia-smi lists no GPU: install the NVIDIA driver or use --device cpu")
    if gpus:
        n = len(gpus) if slots is None else slots
        if n > len(gpus):
            raise AgentError(f"--slots {slots}, but nvidia-smi lists only {len(gpus)} GPUs")
        return Inventory("gpu", n, [name for name, _ in gpus[:n]], gpus[0][1])
    n = slots or DEFAULT_CPU_SLOTS
    return Inventory("cpu", n, ["cpu"] * n, _host_memory_gb())


def default_node() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:128] or "node"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    seconds: float
    detail: str  # devices when it passed, the reason when it failed


async def selfcheck(python: str, inv: Inventory, timeout_s: float, forks: ForkServer | None = None) -> Verdict:
    """`python -m flightdeck.trainer.selfcheck` (matmul with a known answer, all-reduce across the slots) in its own
    session: forked from the node's fork server when it has one (torch imported once), else started cold."""
    started = time.perf_counter()
    argv = [python, "-m", "flightdeck.trainer.selfcheck", "--slots", str(inv.slots), "--device",
            "cuda" if inv.kind == "gpu" else "cpu"]
    try:
        if forks is not None and await asyncio.wait_for(forks.wait_ready(complete=False), timeout_s):
            with contextlib.suppress(ForkServerGone):  # then cold
                return await _forked_selfcheck(forks, argv, started, timeout_s)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=Path.cwd(), env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except TimeoutError:
        return Verdict(False, time.perf_counter() - started, f"self-check did not finish in {timeout_s:g}s")
    got = await _within(proc, proc.communicate(), started, timeout_s)
    if got is None:
        return Verdict(False, time.perf_counter() - started, f"self-check did not finish in {timeout_s:g}s")
    out, err = got
    return _verdict(proc.returncode, out, err, time.perf_counter() - started)


async def _forked_selfcheck(forks: ForkServer, argv: list[str], started: float, timeout_s: float) -> Verdict:
    """The self-check as a child of the fork server, its output (stdout and stderr together) through a pipe."""
    read_end, write_end = os.pipe()
    try:
        proc = await forks.run(Assignment(argv=argv, env=forks.env, cwd=str(forks.cwd)), write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)

    async def collect() -> bytes:
        out = await asyncio.to_thread(_read_all, read_end)  # EOF once the check and its workers are gone
        await proc.wait()
        return out

    out = await _within(proc, collect(), started, timeout_s)
    if out is None:
        return Verdict(False, time.perf_counter() - started, f"self-check did not finish in {timeout_s:g}s")
    return _verdict(proc.returncode, out, out, time.perf_counter() - started)


async def _within(proc: asyncio.subprocess.Process | ForkedProc, work: Awaitable[T], started: float,
                  timeout_s: float) -> T | None:
    """`work` (the check's output), or None if the check is still running `timeout_s` after `started`; it is then
    killed with its session (its own worker processes too), as it is when we are cancelled."""
    try:
        return await asyncio.wait_for(work, max(timeout_s - (time.perf_counter() - started), 0))
    except (TimeoutError, asyncio.CancelledError) as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return None


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def _verdict(code: int | None, out: bytes, err: bytes, seconds: float) -> Verdict:
    """The check's last line is its JSON verdict; without one, the end of what it printed says why."""
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except (json.JSONDecodeError, TypeError):
        result = {}
    if not isinstance(result, dict):
        result = {}
    if code == 0 and result.get("ok") is True:
        # seconds: the whole check as the node waited for it (interpreter and torch start included)
        devices = ", ".join(result.get("devices", []))
        return Verdict(True, seconds, f"devices: {devices}; checks took {result.get('seconds', '?')}s")
    reason = str(result.get("reason") or err.decode(errors="replace").strip()[-2000:] or "no verdict printed")
    return Verdict(False, seconds, f"exit code {code}: {reason}")


async def recheck(node: str, run: Callable[[], Awaitable[Verdict]] | None, args: SelfCheckArgs) -> list[Emit]:
    """The self-check again (`run`), its verdict recorded on the node as at registration (a failure cordons it)."""
    if run is None:
        log.error("no self-check to run on this agent", job_id=args.job_id, reason=args.reason)
        return []
    log.warning("running the node's self-check again", job_id=args.job_id, reason=args.reason)
    verdict = await run()
    event: SelfCheckPassed | SelfCheckFailed
    if verdict.ok:
        event = SelfCheckPassed(node=node, seconds=round(verdict.seconds, 3),
                                detail=f"{verdict.detail} (again: {args.reason})")
    else:
        event = SelfCheckFailed(node=node, reason=f"{verdict.detail} (again: {args.reason})")
    log.info("self-check ran again", ok=verdict.ok, detail=verdict.detail)
    return [Emit(subjects.node(node, type(event).__name__), event)]
