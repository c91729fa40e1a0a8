"""What `flightdeck up` leaves in its data dir for `down` and for a second `up`: a lock held while
it runs (`up.lock`) and a state file with its pids and broker URL (`up.json`); and, in a per-user index
($FLIGHTDECK_UP_INDEX, default ~/.local/state/flightdeck/up), where each running up's data dir is, so
`down --nats URL` finds the up that serves a broker."""

import contextlib
import fcntl
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import msgspec

STATE_FILE = "up.json"
LOCK_FILE = "up.lock"
INDEX_ENV = "FLIGHTDECK_UP_INDEX"
_PROC = Path("/proc/self/stat").exists()


class UpState(msgspec.Struct, kw_only=True):
    pid: int  # the supervisor
    url: str
    data_dir: str
    port: int | None  # None when up uses a broker it did not start
    broker_pid: int | None
    processes: dict[str, int | None]
    status: Literal["starting", "ready", "stopping"]
    started_at: float
    objects: str = ""  # its object store's URL, for a `submit` from elsewhere that ships a job's code there


def index_dir() -> Path:
    if os.environ.get(INDEX_ENV):
        return Path(os.environ[INDEX_ENV])
    state_home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state_home / "flightdeck" / "up"


def _index_entry(data_dir: Path) -> Path:
    return index_dir() / f"{hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]}.txt"


def write_state(data_dir: Path, state: UpState) -> None:
    tmp = data_dir / f".{STATE_FILE}.tmp"
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, data_dir / STATE_FILE)  # readers never see half a file
    with contextlib.suppress(OSError):  # without an index, `down --nats` says what to pass instead
        entry = _index_entry(data_dir)
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(str(data_dir.resolve()))


def _endpoint(url: str) -> tuple[str, int | None]:
    """(host, port) of a broker URL, with this machine's names for itself made one."""
    parsed = urlsplit(url if "://" in url else f"nats://{url}")
    host = parsed.hostname or ""
    return ("local" if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") else host), parsed.port or 4222


def find_by_url(url: str) -> Path | None:
    """The data dir of a running up on this machine whose broker is `url`; stale index entries are dropped."""
    root = index_dir()
    for entry in sorted(root.glob("*.txt")) if root.is_dir() else []:
        data_dir = Path(entry.read_text().strip())
        state = read_state(data_dir)
        if state is None:
            entry.unlink(missing_ok=True)
        elif _endpoint(state.url) == _endpoint(url):
            return data_dir
    return None


def read_state(data_dir: Path) -> UpState | None:
    try:
        return msgspec.json.decode((data_dir / STATE_FILE).read_bytes(), type=UpState)
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def remove_state(data_dir: Path) -> None:
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        _index_entry(data_dir).unlink(missing_ok=True)


def take_lock(data_dir: Path) -> int | None:
    """The lock's file descriptor, held until the process exits (or closes it); None if another holds it.
    A lock, unlike a pid in a file, cannot go stale: the kernel drops it when its holder dies."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_held(data_dir: Path) -> bool:
    if not (data_dir / LOCK_FILE).exists():
        return False
    fd = take_lock(data_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


def alive(pid: int) -> bool:
    """Running: a zombie is not (in a container, pid 1 may never reap what `up --detach` orphans)."""
    if not _PROC:
        return _exists(pid)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(pid: int) -> bool:
    """Whether `pid` still runs one of our programs: a pid in an old state file may have been reused."""
    if not _PROC:
        return True  # nothing to check against: trust the pid
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return any(word in cmdline for word in (b"nats-server", b"services", b"flightdeck"))


def leftovers(state: UpState) -> list[int]:
    """Pids from `state` that still run one of our programs, services before the broker."""
    pids = [p for p in state.processes.values() if p is not None]
    if state.broker_pid is not None:
        pids.append(state.broker_pid)
    return [p for p in pids if alive(p) and _ours(p)]


def terminate(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each pid, wait up to `grace_s` for all, then SIGKILL whatever is left."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
