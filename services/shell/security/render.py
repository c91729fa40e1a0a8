"""The `authorization { users = [...] }` block nats-server loads, written from `permissions.Permissions`.

A password is either a bcrypt hash (a deployment's own file, rendered from its secrets directory) or a
reference to a server environment variable (`$FLIGHTDECK_PW_SCHEDULER`: the shipped infra/nats/accounts.conf,
which holds no secret and is the same on every machine).
"""

import json
import re
from collections.abc import Callable, Sequence

from flightdeck.services.shell.security.permissions import Permissions

HEADER = """\
# Flightdeck's NATS users: one per service and per node agent, plus console and admin. A job's ranks have none.
# Written by `python -m flightdeck.services.shell.security` from its permissions.py; do not edit by hand.
# Include it from the server config (`include accounts.conf`); after adding a node, reload the server
# (`nats-server --signal reload`, or SIGHUP): existing connections are kept.
"""


def env_var(user: str) -> str:
    """The server environment variable the shipped config reads `user`'s password (or its hash) from."""
    return "FLIGHTDECK_PW_" + re.sub(r"[^A-Z0-9]", "_", user.upper())


def _list(items: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _direction(allow: Sequence[str], deny: Sequence[str]) -> str:
    parts = [f"allow: {_list(allow)}"]
    if deny:
        parts.append(f"deny: {_list(deny)}")
    return "{" + ", ".join(parts) + "}"


def user_block(perms: Permissions, password: str) -> str:
    """One user entry; `password` is a literal value for the config (quoted hash or `$VARIABLE`)."""
    head = f"    {{user: {json.dumps(perms.user)}, password: {password}"
    if perms.everything:
        return head + "}"
    responses = "        allow_responses: true\n" if perms.responses else ""
    return (f"{head},\n      permissions: {{\n"
            f"        publish: {_direction(perms.publish, perms.publish_deny)}\n"
            f"        subscribe: {_direction(perms.subscribe, perms.subscribe_deny)}\n"
            f"{responses}"
            f"      }}}}")


def render(users: Sequence[Permissions], password: Callable[[str], str]) -> str:
    """The authorization block; `password(user)` gives each user's config value."""
    names = [u.user for u in users]
    if len(set(names)) != len(names):
        raise ValueError(f"a user appears twice: {sorted(n for n in names if names.count(n) > 1)}")
    body = "\n".join(user_block(u, password(u.user)) for u in users)
    return f"{HEADER}authorization {{\n  users = [\n{body}\n  ]\n}}\n"


def hashed(hashes: Callable[[str], str]) -> Callable[[str], str]:
    """Config values from bcrypt hashes (quoted: a hash holds `$`, which would otherwise start a variable)."""
    return lambda user: json.dumps(hashes(user))


def from_environment(user: str) -> str:
    return "$" + env_var(user)
