"""How a node agent starts ranks: its data dir's layout (Paths), the settings every rank of the node gets
(Launch), a rank's base environment, and the parent-death signal that makes a rank die with its agent.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.shell.security.credentials import AGENT_ONLY

REPO = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@dataclass(frozen=True)
class Paths:
    root: Path  # absolute

    def spec(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id / "spec.toml"

    def cache(self, job_id: str, checkpoint_id: str = "") -> Path:
        base = self.root / "cache" / job_id
        return base / checkpoint_id if checkpoint_id else base

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    def log(self, job_id: str, attempt: int, rank: int) -> Path:
        return self.root / "logs" / f"{job_id}-a{attempt}-r{rank}.log"

    @property
    def standby_log(self) -> Path:
        return self.root / "logs" / "standby.log"  # what standbys print before they become ranks


@dataclass(frozen=True)
class Launch:
    """How ranks are started on this node."""

    nats_url: str
    device: str  # "cpu" or "cuda"
    grace_s: float  # SIGTERM, then this long, then SIGKILL
    python: str = sys.executable
    beats: str = ""  # the agent's heartbeat socket (services/agent/beats.py); "": ranks publish their own
    step_reports: str = "all"  # "rank0": ranks > 0 leave their steps to the agent's batches (trainer/beats.py)


def exit_msg_id(producer: str, job_id: str, attempt: int, rank: int) -> str:
    return f"{producer}:exit:{job_id}:{attempt}:{rank}"


def rank_base_env() -> dict[str, str]:
    """What every rank's environment holds besides its rendezvous variables (a standby starts with this)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",  # a rank's lines reach its log as printed
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}


def standby_env() -> dict[str, str]:
    """A standby's environment: a rank's base without the agent's own identity (a standby becomes a rank; the
    job's credential comes with its assignment, security/credentials.rank_env)."""
    return {k: v for k, v in rank_base_env().items() if k not in AGENT_ONLY}


def die_with_agent(agent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != agent_pid:  # the agent died before prctl took effect
            os._exit(1)
    return preexec


def detached(producer: str, **context: Any) -> None:
    """Give a task started while an input was in hand a log context of its own: it outlives that input."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=producer, **context)
