"""The secrets behind the NATS users, kept in one directory readable only by its owner:

    <dir>/<user>.password   a random password for each service, agent, console and admin user

A job's ranks have no user: their node agent publishes for them (events/ranklink.py). The broker's config holds
only bcrypt hashes.
"""

import os
import secrets
import warnings
from pathlib import Path

from flightdeck.events import subjects

# bcrypt work factor. The server checks it on every connect and reconnect; the secrets made here are 256 random
# bits, which no work factor makes harder to guess, while cost 11 (130 ms of CPU each) took the broker over the
# clients' connect timeout on a loaded 2-core box: `up --listen` then failed to start. Raise it (--cost) for a
# password a person chose.
DEFAULT_COST = 4


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 (created so from the start, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_secret(path: Path) -> str:
    text = path.read_text().strip()
    if not text:
        raise ValueError(f"{path} is empty: it should hold a secret")
    return text


class SecretsDir:
    """The directory of secrets; each one is created on first use and kept after."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _get(self, name: str) -> str:
        path = self.root / name
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        return read_secret(path)

    def password_file(self, user: str) -> Path:
        return self.root / f"{subjects.token(user)}.password"

    def password(self, user: str) -> str:
        return self._get(self.password_file(user).name)



def bcrypt(password: str, cost: int = DEFAULT_COST) -> str:
    """A bcrypt hash nats-server accepts. Python 3.11's `crypt` (glibc/libxcrypt) computes it; the module is
    deprecated, hence the warning filter, and gone in 3.13 (there the `bcrypt` package would take its place)."""
    if not 4 <= cost <= 31:
        raise ValueError(f"bcrypt cost must be between 4 and 31, got {cost}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << cost))
    if not hashed or not hashed.startswith("$2"):
        raise RuntimeError("this system's crypt(3) cannot make bcrypt hashes ($2b$): run the renderer on a "
                           "glibc/libxcrypt system, or hash the passwords with `nats server passwd`")
    return hashed
