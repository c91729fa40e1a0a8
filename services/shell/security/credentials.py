"""How a Flightdeck process presents itself to the broker, from files named in its environment, and how a
node agent hands a job's credential to the ranks it starts.

Why it works this way: docs/internals.md, "9. Security and deployment".
"""

import os
import ssl
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from events import subjects
from services.shell.security.passwords import job_password, read_secret, write_private
from services.shell.security.permissions import inbox, job_user

USER, PASSWORD_FILE, CREDS = "FLIGHTDECK_NATS_USER", "FLIGHTDECK_NATS_PASSWORD_FILE", "FLIGHTDECK_NATS_CREDS"
TLS_CA, TLS_CERT, TLS_KEY = "FLIGHTDECK_NATS_TLS_CA", "FLIGHTDECK_NATS_TLS_CERT", "FLIGHTDECK_NATS_TLS_KEY"
TLS_HOSTNAME, INBOX_PREFIX = "FLIGHTDECK_NATS_TLS_HOSTNAME", "FLIGHTDECK_NATS_INBOX_PREFIX"
JOB_KEY_FILE = "FLIGHTDECK_JOB_KEY_FILE"
RANK_TLS_CERT, RANK_TLS_KEY = "FLIGHTDECK_NATS_RANK_TLS_CERT", "FLIGHTDECK_NATS_RANK_TLS_KEY"
# What identifies the agent itself: never inherited by the ranks it starts.
AGENT_ONLY = (USER, PASSWORD_FILE, CREDS, TLS_CERT, TLS_KEY, INBOX_PREFIX, JOB_KEY_FILE, RANK_TLS_CERT, RANK_TLS_KEY)


class CredentialsError(ValueError):
    """Credentials configured in a way that cannot work; the message names the variable to fix."""


def _file(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name, "")
    if not raw:
        return None
    path = Path(raw)
    if not path.is_file():
        raise CredentialsError(f"${name} names {raw!r}, which is not a readable file")
    return path


def check_url(url: str) -> None:
    """Refuse a broker URL carrying a user or password: URLs are logged and passed on command lines."""
    for one in url.split(","):
        if urlsplit(one.strip()).username is not None:
            raise CredentialsError(f"the broker URL {urlsplit(one.strip()).hostname!r} carries credentials: "
                                   f"remove them from the URL and set ${USER} and ${PASSWORD_FILE}")


def tls_context(env: Mapping[str, str]) -> ssl.SSLContext | None:
    ca, cert, key = _file(env, TLS_CA), _file(env, TLS_CERT), _file(env, TLS_KEY)
    if (cert is None) != (key is None):
        raise CredentialsError(f"set both ${TLS_CERT} and ${TLS_KEY}, or neither")
    if ca is None and cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca else None)
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def client_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for nats-py's `connect` (through `JetStreamStore.connect`): none without settings."""
    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    user = env.get(USER, "")
    password_file, creds = _file(env, PASSWORD_FILE), _file(env, CREDS)
    if password_file is not None and not user:
        raise CredentialsError(f"${PASSWORD_FILE} is set but ${USER} is not")
    if user and password_file is None and creds is None:
        raise CredentialsError(f"${USER} is set but neither ${PASSWORD_FILE} nor ${CREDS} is")
    if user and password_file is not None:
        opts.update(user=user, password=read_secret(password_file))
    if creds is not None:
        opts["user_credentials"] = str(creds)
    prefix = env.get(INBOX_PREFIX, "") or (inbox(user) if user else "")
    if prefix:
        opts["inbox_prefix"] = prefix
    ctx = tls_context(env)
    if ctx is not None:
        opts["tls"] = ctx
        if env.get(TLS_HOSTNAME):
            opts["tls_hostname"] = env[TLS_HOSTNAME]
    return opts


def rank_env(env: MutableMapping[str, str], job_id: str, data_dir: Path) -> MutableMapping[str, str]:
    """The environment a node agent gives a job's ranks: the agent's own identity removed, the job's user
    and a file with the job's password (derived from $FLIGHTDECK_JOB_KEY_FILE) put in, the CA kept.
    Without a job key the ranks get no credential (a broker without authorization)."""
    key_file = _file(env, JOB_KEY_FILE)
    rank_cert, rank_key = env.get(RANK_TLS_CERT, ""), env.get(RANK_TLS_KEY, "")
    for name in AGENT_ONLY:
        env.pop(name, None)
    if key_file is not None:
        path = data_dir / "secrets" / f"{subjects.token(job_id)}.password"
        write_private(path, job_password(read_secret(key_file), job_id) + "\n")
        env[USER], env[PASSWORD_FILE] = job_user(job_id), str(path)
    if rank_cert and rank_key:
        env[TLS_CERT], env[TLS_KEY] = rank_cert, rank_key
    return env
