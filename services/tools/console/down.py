"""`flightdeck down`: stop what `flightdeck up` started for a data dir (the supervisor stops its own
processes; anything a killed supervisor left behind is stopped from the pids in its state file). Without
`--data-dir`, the up serving `--nats` (or $FLIGHTDECK_NATS_URL) is found from the per-user index."""

import argparse
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from flightdeck.services.agent import shmroots
from flightdeck.services.tools.cli import EXIT_NOT_FOUND, Command, UserError
from flightdeck.services.tools.console import upstate
from flightdeck.services.tools.console.up import DEFAULT_DATA_DIR

NATS_URL_ENV = "FLIGHTDECK_NATS_URL"
STOP_TIMEOUT_S = 30.0  # the supervisor gives each process 10 s, then the broker 10 s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", metavar="DIR",
                        help="the data dir `up` used (default: the up serving --nats, else ./.flightdeck)")
    parser.add_argument("--nats", metavar="URL",
                        help="the broker URL of the up to stop (default: $FLIGHTDECK_NATS_URL)")


def run(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir or DEFAULT_DATA_DIR).resolve()
    state = _state_of_running(data_dir)
    url = args.nats or (os.environ.get(NATS_URL_ENV) if args.data_dir is None else None)
    if state is None and not upstate.lock_held(data_dir) and url:
        found = upstate.find_by_url(url)
        if found is not None:
            data_dir, state = found, _state_of_running(found)
        elif _answers(url):
            raise UserError(f"a broker answers at {url}, but no flightdeck up on this machine serves it: pass the "
                            "--data-dir it was started with, or stop it where it was started", EXIT_NOT_FOUND)
    if state is None and not upstate.lock_held(data_dir):
        print(f"nothing to stop: no flightdeck up is running for {data_dir}" + (f" or serving {url}" if url else ""))
        return 0
    if upstate.lock_held(data_dir):
        if state is None:
            raise UserError(f"flightdeck up holds {data_dir / upstate.LOCK_FILE} but wrote no state yet; retry")
        _stop_supervisor(data_dir, state.pid)
    if state is not None:
        upstate.terminate(upstate.leftovers(state))
    upstate.remove_state(data_dir)
    if state is not None:
        print(f"flightdeck stopped: supervisor pid {state.pid}, {len(state.processes)} services, broker {state.url}")
    for line in left_in_memory(data_dir):
        print(line)
    return 0


def left_in_memory(data_dir: Path, shm: Path = shmroots.SHM) -> list[str]:
    """What the stopped agents' ranks left in shared memory (RAM): the snapshots of jobs still live, which the next
    `flightdeck up` of this data dir persists (an ended job's are freed when it ends). Said, never silently kept."""
    out = []
    for root, size, jobs in shmroots.left_by(data_dir, shm):
        named = ", ".join(jobs[:5]) + (f" and {len(jobs) - 5} more" if len(jobs) > 5 else "")
        out.append(f"left in shared memory: {size / 2**20:.1f} MiB of snapshots of {len(jobs)} live job(s) "
                   f"({named or 'none'}) in {root}: the next `flightdeck up --data-dir {data_dir}` persists them; "
                   f"`rm -rf {root}` frees them now")
    return out


def _answers(url: str) -> bool:
    """Whether something accepts connections at the broker URL's address."""
    parsed = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=1.0):
            return True
    except OSError:
        return False


def _state_of_running(data_dir: Path) -> upstate.UpState | None:
    """The state file; an up that holds the lock but is still starting may not have written it yet."""
    deadline = time.monotonic() + 2.0
    while (state := upstate.read_state(data_dir)) is None and upstate.lock_held(data_dir):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return state


def _stop_supervisor(data_dir: Path, pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    # It lets go of the lock once it has stopped everything, a moment before it exits.
    while upstate.lock_held(data_dir) or upstate.alive(pid):
        if time.monotonic() > deadline:
            # Its children die with it (PR_SET_PDEATHSIG); the broker is stopped from the state file.
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            break
        time.sleep(0.05)


COMMAND = Command("down", "stop what `flightdeck up` started", add_arguments, run)
