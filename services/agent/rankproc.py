"""What the node agent knows of a rank it started, and the plain helpers around one: signalling it, what it
printed last, whether its command can run at all, and retrying the records it leaves."""

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from flightdeck.events.job import SlotRef
from flightdeck.services.agent.core import Restore
from flightdeck.services.shell.connection import TRANSIENT

log = structlog.get_logger("flightdeck.agent")


class Proc(Protocol):
    """What the agent uses of a process it runs: an asyncio subprocess, or one its fork server forked."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


@dataclass(eq=False)
class RankProc:
    job_id: str
    attempt: int
    ref: SlotRef
    proc: Proc
    cause: str  # the grant's event id
    restore: Restore | None = None  # the checkpoint it was started to load
    shutdown: bool = False  # stopped because the agent is going away, not because the job let it go
    watcher: asyncio.Task[None] | None = None
    output: asyncio.Task[None] | None = None  # its OutputPump: the log file and FD_LOGS
    code: str = ""  # the sha256 of the shipped code it runs in (codecache.py keeps that copy), "": none

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


def signal_rank(p: RankProc, sig: int) -> None:
    if p.alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.proc.pid, sig)  # its own session: whatever it started goes too


async def retrying(what: str, fn: Callable[[], Any]) -> Any:
    """Await `fn()` until the broker takes it (it may be restarting)."""
    delay = 0.1
    while True:
        try:
            return await fn()
        except TRANSIENT as exc:
            log.warning(f"{what} failed; retrying", error=repr(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def runnable_problem(cmd: list[str], cwd: Path, search_path: str) -> str | None:
    """Why `cmd` cannot be started in `cwd` (the program or the directory is missing, or not executable),
    or None. Checked before anything starts, so the job's history says so in words instead of a bare code."""
    shown = " ".join(cmd)[:300]
    if not cwd.is_dir():
        return f"cannot run {shown!r}: its working directory {cwd} does not exist on node"
    program = cmd[0]
    if "/" in program:
        path = program if os.path.isabs(program) else str(cwd / program)
        found = path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    else:
        found = shutil.which(program, path=search_path or os.defpath)
    if found is None:
        return f"cannot run {shown!r}: {program!r} is not an executable file (not found in the working directory " \
               f"{cwd} or on PATH)"
    if len(cmd) > 1 and os.path.basename(found).startswith("python") and not cmd[1].startswith("-"):
        script = cmd[1] if os.path.isabs(cmd[1]) else str(cwd / cmd[1])
        if not os.path.isfile(script):
            return f"cannot run {shown!r}: the script {cmd[1]!r} does not exist (working directory {cwd})"
    return None


def last_lines(path: Path, max_bytes: int = 2048, max_lines: int = 20) -> str:
    """The end of a rank's output: what a failed rank said last (usually its traceback), read on into the rotated
    file before it (output.rotated) when the current one holds less."""
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - max_bytes, 0))
            data = f.read()
    except OSError:
        return ""
    if len(data) < max_bytes and (before := path.with_name(path.name + ".1")).is_file():
        with contextlib.suppress(OSError), before.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - (max_bytes - len(data)), 0))
            data = f.read() + data
    lines = data.decode(errors="replace").splitlines()[-max_lines:]
    return "\n".join(lines).strip()



def error_line(tail: str) -> str:
    """The exception a Python traceback in `tail` ends with ("ModuleNotFoundError: No module named 'x'"), or "":
    the first unindented line after the last "Traceback (most recent call last):" (its frames are indented; what
    follows the exception's first line, its message's rest or lines printed after it, is not the error)."""
    lines = tail.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    after = (line for line in lines[starts[-1] + 1:] if line.strip() and not line[0].isspace())
    return next(after, "").strip()[:500]  # as links.MAX_ERROR


# A line a logging library wrote, and its level: structlog's console ("2026-11-28 10:50:49 [info     ] ..."), the
# standard library's default ("INFO:root:...") and its common formats ("2026-11-28 10:50:49,123 INFO ...").
LOG_RECORD = re.compile(r"^(?:\S+\s+)?(?:\d{4}-\d\d-\d\d[ T][\d:.,]+\S*\s+)?(?:\[\s*)?"
                        r"(debug|info|warning|warn|error|critical|fatal|exception)\b[\s:\]-]", re.IGNORECASE)
QUIET_LEVELS = frozenset({"debug", "info", "warning", "warn"})
ERROR_WORDS = re.compile(r"error|exception|fatal|abort|segmentation fault|terminate called|killed|panic",
                         re.IGNORECASE)


def error_of(tail: str) -> str:
    """What a failed rank's output says its error was, on one line, or "": the exception its last traceback ends with,
    else its last line that names an error (a log record's only when logged at error level or worse: the info and
    warning records a library writes on the way out are not the error)."""
    if found := error_line(tail):
        return found
    for line in reversed(tail.splitlines()):
        text = line.strip()
        record = LOG_RECORD.match(text)
        if record is not None and record.group(1).lower() in QUIET_LEVELS:
            continue
        if record is not None or ERROR_WORDS.search(text):
            return text[:500]
    return ""
