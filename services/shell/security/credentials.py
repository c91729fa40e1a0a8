"""How a Flightdeck process presents itself to the broker, from files named in its environment, and what of it a
node agent keeps from the ranks it starts (all of it).

Why it works this way: docs/internals.md, "9. Security and deployment".
"""

import os
import ssl
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flightdeck.services.shell.security.passwords import read_secret
from flightdeck.services.shell.security.permissions import inbox

USER, PASSWORD_FILE, CREDS = "FLIGHTDECK_NATS_USER", "FLIGHTDECK_NATS_PASSWORD_FILE", "FLIGHTDECK_NATS_CREDS"
TLS_CA, TLS_CERT, TLS_KEY = "FLIGHTDECK_NATS_TLS_CA", "FLIGHTDECK_NATS_TLS_CERT", "FLIGHTDECK_NATS_TLS_KEY"
TLS_HOSTNAME, INBOX_PREFIX = "FLIGHTDECK_NATS_TLS_HOSTNAME", "FLIGHTDECK_NATS_INBOX_PREFIX"
# The broker's address and every credential variable start with this: the agent gives its ranks none of them.
BROKER_PREFIX = "FLIGHTDECK_NATS"


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


def rank_env(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """The environment a node agent gives the ranks it starts: nothing of the broker. No address, no user, no
    secret, no certificate: a rank's only link to the platform is its agent (events/ranklink.py)."""
    for name in [n for n in env if n.startswith(BROKER_PREFIX)]:
        del env[name]
    return env
