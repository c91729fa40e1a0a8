"""The trainer's background link to NATS: an asyncio loop on its own daemon thread, and a connection
that keeps retrying, so the training thread never waits on the broker."""

import asyncio
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS

from events.streams import server_list

RECONNECT_WAIT_S = 0.5
CONNECT_TIMEOUT_S = 2
ERROR_LOG_EVERY_S = 5.0  # a broker that stays down would otherwise log an error every reconnect attempt


class LoopThread:
    """Runs one coroutine on a fresh event loop in a daemon thread.

    Daemon, so a rank that dies or exits without closing takes its publishers with it: a dead
    process must stop heartbeating."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def start(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        assert self._thread is None, "a LoopThread runs once"
        self._thread = threading.Thread(target=self._run, args=(main,), name=self._name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(main())
        self._started.set()
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop thread; a no-op once the loop has finished."""
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed: the thread already finished
            pass

    def cancel(self) -> None:
        task = self._task
        if task is not None:
            self.call_soon(task.cancel)

    def join(self, timeout: float) -> bool:
        """Wait for the coroutine to finish; True when it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


async def connect(url: str, name: str, log: Any,
                  on_change: Callable[[bool], Awaitable[None]] | None = None) -> NATS:
    """Connect, retrying for as long as it takes (cancel the task to give up), and reconnect forever after.

    nats-py treats `max_reconnect_attempts=-1` as "keep trying" for the first connect too, so a broker
    that is down when the rank starts is simply waited for, in the background. `on_change(up)` hears
    when the broker comes (True: connected or reconnected) and goes (False: disconnected, or an error)."""
    last_error_log = 0.0
    conn: list[NATS] = []

    async def changed(up: bool) -> None:
        if on_change is not None:
            await on_change(up)

    async def error_cb(exc: Exception) -> None:
        nonlocal last_error_log
        if isinstance(exc, OSError | TimeoutError | nats.errors.NoServersError | nats.errors.StaleConnectionError):
            await changed(False)
        now = time.monotonic()
        if now - last_error_log >= ERROR_LOG_EVERY_S:
            last_error_log = now
            log.warning("bus.error", error=f"{type(exc).__name__}: {exc}")

    async def disconnected_cb() -> None:
        if conn and conn[0].is_closed:
            return  # our own close, not an outage
        log.warning("bus.disconnected")
        await changed(False)

    async def reconnected_cb() -> None:
        log.info("bus.reconnected")
        await changed(True)

    nc = await nats.connect(
        server_list(url),  # one URL or several, comma-separated (a cluster)
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        connect_timeout=CONNECT_TIMEOUT_S,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        **credentials(),
    )
    conn.append(nc)
    log.info("bus.connected", url=url)
    await changed(True)
    return nc


async def close_quietly(nc: NATS | None, wait_s: float) -> None:
    """Close a connection without letting a dead broker hold the caller past `wait_s`."""
    if nc is None or nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.close(), max(wait_s, 0.01))
    except (TimeoutError, nats.errors.Error, OSError):
        pass


def _secret_file(env: Mapping[str, str], name: str) -> str:
    path = env.get(name, "")
    if path and not os.path.isfile(path):
        raise ValueError(f"${name} names {path!r}, which is not a readable file")
    return path


def credentials(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """nats-py options from the variables services/shell/security/credentials.py documents (the node agent sets
    them for its ranks): the job's user and a file with its password, TLS CA and client certificate. The
    password is read here and kept in the connection only: never logged, never on a command line."""
    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    user, password_file = env.get("FLIGHTDECK_NATS_USER", ""), _secret_file(env, "FLIGHTDECK_NATS_PASSWORD_FILE")
    creds = _secret_file(env, "FLIGHTDECK_NATS_CREDS")
    if bool(user) != bool(password_file) and not creds:
        raise ValueError("set both $FLIGHTDECK_NATS_USER and $FLIGHTDECK_NATS_PASSWORD_FILE, or neither")
    if user and password_file:
        with open(password_file) as f:
            opts.update(user=user, password=f.read().strip())
    if creds:
        opts["user_credentials"] = creds
    if prefix := env.get("FLIGHTDECK_NATS_INBOX_PREFIX", "") or (f"_INBOX.{user}" if user else ""):
        opts["inbox_prefix"] = prefix  # the only reply subjects the user's permissions let it read
    ca, cert, key = (_secret_file(env, f"FLIGHTDECK_NATS_TLS_{n}") for n in ("CA", "CERT", "KEY"))
    if bool(cert) != bool(key):
        raise ValueError("set both $FLIGHTDECK_NATS_TLS_CERT and $FLIGHTDECK_NATS_TLS_KEY, or neither")
    if ca or cert:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
        if cert:
            ctx.load_cert_chain(cert, key)
        opts["tls"] = ctx
        if env.get("FLIGHTDECK_NATS_TLS_HOSTNAME"):
            opts["tls_hostname"] = env["FLIGHTDECK_NATS_TLS_HOSTNAME"]
    return opts


def logger(component: str, job_id: str, rank: int, attempt: int) -> Any:
    return structlog.get_logger(component).bind(job_id=job_id, rank=rank, attempt=attempt)
