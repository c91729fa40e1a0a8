"""Snapshot roots in shared memory: who owns each, and the reclaim of those whose agent and platform are gone.

Shared memory is RAM. A root (`/dev/shm/flightdeck-<node>-<tag>`, one per agent data dir) outlives its agent: the
next agent of the same data dir persists what its ranks left (agent.reconcile). A root whose agent is dead and
whose data dir no longer exists has no such next agent, and nothing else would ever free it: after a day of trials
52 of them held 800 MB (issue 51). Each agent marks its root with its pid and data dir at start, and reclaims the
roots of dead agents whose data dir is gone (and empty roots nobody owns).
"""

import json
import os
import shutil
from pathlib import Path

import structlog

log = structlog.get_logger("flightdeck.agent.snapshots")

SHM = Path("/dev/shm")  # shared memory (tmpfs), where a machine has it
OWNER = ".owner"  # in each root: {"pid": ..., "data_dir": ...} of the agent that uses it
PREFIX = "flightdeck-"


def claim(root: Path, data_dir: Path) -> None:
    """Mark `root` as this process's, for the agents that look at it later."""
    mark = json.dumps({"pid": os.getpid(), "data_dir": str(data_dir.resolve())})
    for _ in range(3):  # an agent reclaiming empty roots may remove this one between its creation and its mark
        root.mkdir(parents=True, exist_ok=True)
        try:
            (root / OWNER).write_text(mark)
            return
        except FileNotFoundError:
            continue
    raise OSError(f"could not mark the snapshot root {root} as this agent's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _size(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def abandoned(root: Path) -> str:
    """Why `root` can be reclaimed ("" if it cannot): its agent is dead and its data dir gone, or it is empty and
    marked by no one (a root made before owners were marked, or by an agent killed before it marked it)."""
    try:
        owner = json.loads((root / OWNER).read_text())
        pid, data_dir = int(owner["pid"]), Path(str(owner["data_dir"]))
    except (OSError, ValueError, KeyError, TypeError):
        return "" if any(root.iterdir()) else "empty and owned by no agent"
    if _alive(pid) or data_dir.exists():  # its agent runs, or a next one of that data dir may still persist it
        return ""
    return f"its agent (pid {pid}) is gone and so is its data dir {data_dir}"


def reclaim(own: Path) -> list[tuple[Path, int, str]]:
    """Remove the abandoned roots beside `own` (only under a shared-memory folder, where they cost RAM); each one
    removed, with the bytes it held and why."""
    parent = own.parent
    if not own.name.startswith(PREFIX) or not parent.is_dir():
        return []
    freed = []
    for root in sorted(parent.glob(f"{PREFIX}*")):
        if root == own or not root.is_dir():
            continue
        try:
            why = abandoned(root)
            if not why:
                continue
            size = _size(root)
            shutil.rmtree(root)
        except OSError as exc:  # another agent reclaiming it at the same moment, or not ours to remove
            log.warning("could not reclaim a snapshot root", root=str(root), error=repr(exc))
            continue
        log.info("reclaimed the snapshot root of a dead agent", root=str(root), bytes=size, why=why)
        freed.append((root, size, why))
    return freed


def left_by(data_dir: Path, shm: Path) -> list[tuple[Path, int, list[str]]]:
    """The roots under `shm` whose agent's data dir is `data_dir` or inside it, with the bytes they hold and the
    jobs they hold snapshots of: what `flightdeck down` leaves in memory for the next `up` to persist."""
    out = []
    base = data_dir.resolve()
    for root in sorted(shm.glob(f"{PREFIX}*")) if shm.is_dir() else []:
        try:
            owner = Path(str(json.loads((root / OWNER).read_text())["data_dir"]))
            if owner != base and base not in owner.parents:
                continue
            jobs = sorted(p.name for p in root.iterdir() if p.is_dir())
            size = _size(root)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if jobs:
            out.append((root, size, jobs))
    return out
