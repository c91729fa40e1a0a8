"""`flightdeck up`: start the embedded broker and every service, and supervise them until stopped.

In the foreground it is a process manager (Ctrl-C or SIGTERM stops services first, then the broker);
with `--detach` it starts the same thing in a new session and returns once everything is ready.
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from secrets import token_urlsafe
from types import FrameType
from typing import Literal

import structlog

from flightdeck.services import registry
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.objects.open import DATA_DIR_ENV, objects_url
from flightdeck.services.shell.security import permissions
from flightdeck.services.shell.security.__main__ import rendered
from flightdeck.services.shell.security.credentials import PASSWORD_FILE, USER
from flightdeck.services.shell.security.passwords import SecretsDir, write_private
from flightdeck.services.tools.cli import Command, UserError, add_nats_argument
from flightdeck.services.tools.connect import connect
from flightdeck.services.tools.console import upstate
from flightdeck.services.tools.console.readiness import listening
from flightdeck.services.tools.console.supervisor import Backoff, ProcessSpec, Supervisor
from flightdeck.services.tools.console.ui_cmd import DEFAULT_PORT as DEFAULT_UI_PORT

log = structlog.get_logger("flightdeck.up")

# Processes `up` runs beside the services (every name in flightdeck.services.registry): (name, arguments after
# the python executable); `--nats URL` is appended to each. One line here adds one (the node agent).
CONSOLE = "flightdeck.services.tools.console"
OTHER_PROCESSES: tuple[tuple[str, tuple[str, ...]], ...] = (("agent", ("-m", CONSOLE, "agent")),)
READY_AFTER_S = 1.0  # every process alive this long, and every service reading (readiness.py): ready
DETACH_TIMEOUT_S = 60.0
DEFAULT_DATA_DIR = ".flightdeck"
LOOPBACK = "127.0.0.1"
UI_PORT_ENV = "FLIGHTDECK_UI_PORT"
OPERATOR_TOKEN = "operator-token"  # in the data dir: the dashboard acts on jobs for whoever presents it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_argument(parser, "use this running broker instead of starting the embedded one")
    parser.add_argument("--data-dir", metavar="DIR", default=DEFAULT_DATA_DIR,
                        help="where the broker's store, logs and state live (default: ./.flightdeck)")
    parser.add_argument("--port", type=int, default=4222, help="port for the embedded broker (default: 4222)")
    parser.add_argument("--detach", action="store_true", help="run in the background; `flightdeck down` stops it")
    parser.add_argument("--listen", default=LOOPBACK, metavar="ADDR",
                        help="the address the embedded broker listens on, so other hosts' agents can join "
                             f"(default: {LOOPBACK}); any other needs --secrets")
    parser.add_argument("--ui-port", type=int, default=int(os.environ.get(UI_PORT_ENV) or DEFAULT_UI_PORT),
                        metavar="PORT", help="serve `flightdeck ui` (dashboard, /metrics) on this localhost port "
                        f"(default: ${UI_PORT_ENV}, else {DEFAULT_UI_PORT}; 0: no web server)")
    parser.add_argument("--secrets", default=None, metavar="DIR",
                        help="users and passwords (created if missing): every connection then needs "
                             "credentials (a job's ranks need none: their agent is their only link)")


def process_specs(url: str, data_dir: Path, secrets: Path | None = None, ui_port: int = 0) -> list[ProcessSpec]:
    """Every service, the node agent and the web server on `ui_port` (0: none), each as its own broker user with
    `secrets` (the web server as `console`: it only reads)."""
    ui = [("ui", ("-m", "flightdeck.services.tools.console", "ui", "--port", str(ui_port), "--operator-token-file",
                  str(operator_token(data_dir))))] if ui_port else []
    table = [*((name, ("-m", "flightdeck.services", name)) for name in registry.names()), *OTHER_PROCESSES, *ui]
    env = {"FLIGHTDECK_NATS_URL": url, "FLIGHTDECK_DATA_DIR": str(data_dir)}
    if secrets is None:
        return [ProcessSpec(name, (sys.executable, *args, "--nats", url), env) for name, args in table]
    vault = SecretsDir(secrets)

    def user(name: str) -> dict[str, str]:
        who = permissions.AGENT if name == "agent" else permissions.CONSOLE if name == "ui" else name
        vault.password(who)
        return {**env, USER: who, PASSWORD_FILE: str(vault.password_file(who))}

    return [ProcessSpec(name, (sys.executable, *args, "--nats", url), user(name)) for name, args in table]


def operator_token(data_dir: Path) -> Path:
    """The dashboard's operator token for this data dir (made once, mode 0600): whoever can read it may act on jobs
    from the web page, as whoever may run the CLI here can."""
    path = data_dir / OPERATOR_TOKEN
    if not path.is_file():
        write_private(path, token_urlsafe(24) + "\n")
    return path


def secured(data_dir: Path, secrets: Path) -> Path:
    """The broker config for a broker on the network: Flightdeck's users, hashed."""
    vault = SecretsDir(secrets)
    accounts = data_dir / "nats-accounts.conf"
    write_private(accounts, rendered(vault, ()))
    conf = data_dir / "nats-server.conf"
    conf.write_text(broker_mod.CONFIG.read_text() + f"\ninclude {json.dumps(accounts.name)}\n")
    return conf


def check_listen(args: argparse.Namespace) -> None:
    """Never an open broker on the network: listening anywhere but loopback takes credentials."""
    if args.nats is None and args.listen not in (LOOPBACK, "localhost") and args.secrets is None:
        raise UserError(f"--listen {args.listen} puts the broker on the network: pass --secrets DIR too, so that "
                        "every connection needs credentials (flightdeck never runs an open broker there)")


def run(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    check_listen(args)
    secrets = Path(args.secrets).resolve() if args.secrets else None
    if args.detach:
        return detach(args, data_dir)
    lock = _lock(data_dir)
    _clean_leftovers(data_dir)
    if args.nats is None:
        check_port(args.port, args.listen)
    check_ui_port(args.ui_port)
    try:
        registry.names()
    except registry.UnknownService as exc:
        raise UserError(str(exc)) from None
    stopping = _StopFlag()
    stopping.install()
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    broker = None
    if secrets is not None:  # this process provisions the streams and checks readiness as `admin`
        vault = SecretsDir(secrets)
        vault.password(permissions.ADMIN)
        os.environ[USER], os.environ[PASSWORD_FILE] = permissions.ADMIN, str(vault.password_file(permissions.ADMIN))
    if args.nats is None:
        config = secured(data_dir, secrets) if secrets is not None else broker_mod.CONFIG
        broker = _start_broker(data_dir, args.port, args.listen, config)
    url = broker.url if broker else args.nats
    try:
        asyncio.run(_provision(url))
    except UserError:
        if broker:
            broker.stop()
        raise
    up = _Up(data_dir, url, broker, secrets, args.ui_port)
    try:
        up.run(stopping)
    finally:
        up.stop()
        os.close(lock)
    return 0


async def _provision(url: str) -> None:
    """The streams exist before any service starts, so readiness means the same thing everywhere."""
    store = await connect(url)
    await store.close()


class _StopFlag:
    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._set)
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum != 0


@dataclass
class _Up:
    data_dir: Path
    url: str
    broker: broker_mod.Broker | None
    secrets: Path | None = None
    ui_port: int = 0

    def __post_init__(self) -> None:
        self.started_at = time.time()
        self.status: Literal["starting", "ready", "stopping"] = "starting"
        self.supervisor = Supervisor(process_specs(self.url, self.data_dir, self.secrets, self.ui_port),
                                     self.data_dir / "logs",
                                     on_change=self.save)
        self._broker_backoff = Backoff()
        self._broker_failures = 0
        self._broker_started = time.monotonic()
        self._broker_due: float | None = None
        self._reading: set[str] = set()
        self._checked_at = 0.0

    def save(self) -> None:
        upstate.write_state(self.data_dir, upstate.UpState(
            pid=os.getpid(), url=self.url, data_dir=str(self.data_dir),
            port=self.broker.port if self.broker else None,
            broker_pid=self.broker.proc.pid if self.broker else None,
            processes=self.supervisor.pids(), status=self.status, started_at=self.started_at,
            objects=objects_url({**os.environ, DATA_DIR_ENV: str(self.data_dir)})))

    def run(self, stopping: _StopFlag) -> None:
        self.supervisor.start()
        print(f"flightdeck: broker {self.url}" + (f" (store {self.broker.store_dir})" if self.broker else ""),
              flush=True)
        for child in self.supervisor.children:
            print(f"flightdeck: {child.spec.name} pid {child.pid}, log {child.log_path}", flush=True)
        if self.secrets is None and self.broker is not None:
            print(f"flightdeck: no --secrets: the broker trusts every client that reaches {self.url}; anyone on this "
                  "host can submit, cancel, or forge any decision (docs/security.md, \"Without credentials\")",
                  flush=True)
        if self.secrets is not None:
            vault = SecretsDir(self.secrets)
            print(f"flightdeck: credentials in {self.secrets}; another host's agent joins with\n"
                  f"  {USER}=agent {PASSWORD_FILE}=<copy of {vault.password_file(permissions.AGENT)}> "
                  f"flightdeck agent --nats {self.url} --address <its address>\n"
                  f"  and the CLI with {USER}=console {PASSWORD_FILE}={vault.password_file(permissions.CONSOLE)}",
                  flush=True)
        while not stopping:
            self.supervisor.step()
            self._watch_broker()
            if self.status == "starting" and self.supervisor.running_for(READY_AFTER_S) and self._services_reading():
                self.status = "ready"
                self.save()
                if self.ui_port:
                    print(f"flightdeck: dashboard {ui_url(self.ui_port)}/, metrics {ui_url(self.ui_port)}/metrics; "
                          f"operator token in {self.data_dir / OPERATOR_TOKEN}", flush=True)
                print("flightdeck: ready; Ctrl-C (or `flightdeck down`) stops everything", flush=True)
            time.sleep(0.1)
        print(f"flightdeck: stopping (signal {signal.Signals(stopping.signum).name})", flush=True)

    def stop(self) -> None:
        self.status = "stopping"
        self.save()
        self.supervisor.stop()
        if self.broker:
            self.broker.stop()
        upstate.remove_state(self.data_dir)
        print("flightdeck: stopped", flush=True)

    def _services_reading(self) -> bool:
        """Whether every service has been seen reading its consumer (checked at most twice a second)."""
        waiting = set(registry.names()) - self._reading
        if waiting and time.monotonic() - self._checked_at >= 0.5:
            self._checked_at = time.monotonic()
            self._reading |= asyncio.run(listening(self.url, waiting))
        return not (set(registry.names()) - self._reading)

    def _watch_broker(self) -> None:
        """The broker is restarted like any process (same port, same store), without blocking the loop."""
        if self.broker is None or self.broker.proc.poll() is None:
            return
        now = time.monotonic()
        if self._broker_due is None:
            if now - self._broker_started >= self._broker_backoff.reset_after_s:
                self._broker_failures = 0
            self._broker_failures += 1
            delay = self._broker_backoff.delay(self._broker_failures)
            self._broker_due = now + delay
            log.warning("broker exited", exit_code=self.broker.proc.returncode, restart_in_s=delay)
            return
        if now < self._broker_due:
            return
        try:
            self.broker = self.broker.restart()  # same port, store, config and address
        except broker_mod.BrokerError as exc:
            log.error("broker did not restart", error=str(exc))
            self._broker_due = None  # counts as another failure: the next try waits longer
            self._broker_started = time.monotonic()
            return
        log.info("broker restarted", pid=self.broker.proc.pid)
        self._broker_due = None
        self._broker_started = time.monotonic()
        self.save()


def ui_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def check_ui_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise UserError(f"--ui-port {port}: choose 1-65535, or 0 for no web server")
    if port == 0:
        return
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            raise UserError(f"port {port} for the web server is taken (another flightdeck up?): pass --ui-port N, "
                            "or --ui-port 0 for none") from None


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Refuse early when the port is taken, rather than let nats-server fail in its log."""
    if port == 0:
        return
    with socket.socket() as s:
        # nats-server sets SO_REUSEADDR too: a port in TIME_WAIT is free for it, a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise UserError(f"port {port} is taken (another nats-server or flightdeck up?): pass --port N, "
                            "or --nats URL to use a broker that is already running") from None


def _lock(data_dir: Path) -> int:
    fd = upstate.take_lock(data_dir)
    if fd is None:
        state = upstate.read_state(data_dir)
        where = f" (supervisor pid {state.pid}, broker {state.url})" if state else ""
        raise UserError(f"flightdeck up is already running for {data_dir}{where}: "
                        "`flightdeck down` stops it, or pass another --data-dir")
    return fd


def _clean_leftovers(data_dir: Path) -> None:
    """A supervisor that was SIGKILLed left its state file, and perhaps its broker, behind."""
    state = upstate.read_state(data_dir)
    if state is not None:
        pids = upstate.leftovers(state)
        if pids:
            log.warning("stopping processes left by an earlier up", pids=pids)
            upstate.terminate(pids)
        upstate.remove_state(data_dir)


def _start_broker(data_dir: Path, port: int, host: str = LOOPBACK, config: Path = broker_mod.CONFIG
                  ) -> broker_mod.Broker:
    try:
        return broker_mod.start(data_dir / "nats", port, log_path=data_dir / "logs" / "nats-server.log", host=host,
                                config=config)
    except broker_mod.BrokerError as exc:
        raise UserError(str(exc)) from None


def detach(args: argparse.Namespace, data_dir: Path) -> int:
    """Run `up` (without --detach) in a new session, logging to logs/up.log; return once it is ready."""
    lock = _lock(data_dir)  # refuse here, with the message a foreground up would give
    try:
        _clean_leftovers(data_dir)
        if args.nats is None:
            check_port(args.port, args.listen)
        check_ui_port(args.ui_port)
    finally:
        os.close(lock)
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", CONSOLE, "up", "--data-dir", str(data_dir), "--port", str(args.port)]
    if args.nats is not None:
        argv += ["--nats", args.nats]
    argv += ["--listen", args.listen, "--ui-port", str(args.ui_port)]
    argv += ["--secrets", str(Path(args.secrets).resolve())] if args.secrets else []
    with open(logs / "up.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + DETACH_TIMEOUT_S
    while (state := upstate.read_state(data_dir)) is None or state.pid != proc.pid or state.status != "ready":
        if proc.poll() is not None:
            raise UserError(f"flightdeck up exited with code {proc.returncode}: {_tail(logs / 'up.log')}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise UserError(f"flightdeck up was not ready after {DETACH_TIMEOUT_S:.0f}s; see the logs in {logs}")
        time.sleep(0.1)
    print(f"flightdeck is up: broker {state.url}, supervisor pid {state.pid}")
    print(f"  {len(state.processes)} services: {', '.join(state.processes)}; logs in {logs}")
    if args.ui_port:
        print(f"  dashboard {ui_url(args.ui_port)}/ ; metrics (Prometheus) at {ui_url(args.ui_port)}/metrics; "
              f"to act on jobs there, paste the operator token in {data_dir / OPERATOR_TOKEN}")
    if state.url != broker_mod.DEFAULT_URL:
        print(f"  other commands find it with --nats {state.url} or: export FLIGHTDECK_NATS_URL={state.url}")
    same_dir = data_dir == Path(DEFAULT_DATA_DIR).resolve()
    print(f"  `flightdeck down{'' if same_dir else f' --data-dir {args.data_dir}'}` stops it")
    return 0


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


COMMAND = Command("up", "start the broker and every service, and keep them running", add_arguments, run)
