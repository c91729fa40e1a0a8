"""A real nats-server running Flightdeck's generated users config (bcrypt at the shipped cost, 4),
on a free port with a temp store, its streams provisioned by `admin`.

    from tests.security.secure_broker import SecureBroker, secure_broker   # the fixture
"""

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest

from flightdeck.events.jetstream import JetStreamStore
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.security import permissions
from flightdeck.services.shell.security.__main__ import rendered
from flightdeck.services.shell.security.credentials import PASSWORD_FILE, USER, client_options
from flightdeck.services.shell.security.passwords import SecretsDir

NODES = ("n1",)
# nats-py waits 2 s for the server's answer to CONNECT by default; a loaded CI box (bcrypt) has taken longer,
# and a refused connection must fail as refused, not as a timeout.
CONNECT_TIMEOUT_S = 60


@dataclass
class SecureBroker:
    root: Path
    nodes: tuple[str, ...] = NODES
    broker: broker_mod.Broker | None = None
    secrets: SecretsDir = field(init=False)

    def __post_init__(self) -> None:
        self.secrets = SecretsDir(self.root / "secrets")

    @property
    def url(self) -> str:
        assert self.broker is not None
        return self.broker.url

    @property
    def accounts(self) -> Path:
        return self.root / "accounts.conf"

    def write_config(self) -> Path:
        self.accounts.write_text(rendered(self.secrets, self.nodes))
        conf = self.root / "server.conf"
        conf.write_text(broker_mod.CONFIG.read_text() + '\ninclude "accounts.conf"\n')
        return conf

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.broker = broker_mod.start(self.root / "store", config=self.write_config())

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()

    def env(self, user: str) -> dict[str, str]:
        """The environment a process of `user` runs with: its name and the file holding its password."""
        self.secrets.password(user)
        return {USER: user, PASSWORD_FILE: str(self.secrets.password_file(user))}

    def agent_env(self, node: str = "n1") -> dict[str, str]:
        """A node agent's: its own user."""
        return self.env(permissions.agent_user(node))

    def options(self, user: str) -> dict[str, Any]:
        return client_options(self.env(user))

    async def store(self, user: str, **extra: Any) -> JetStreamStore:
        return await JetStreamStore.connect(self.url, name=f"test-{user}", provision=False,
                                            **self.options(user), **extra)

    async def raw(self, user: str, errors: list[str] | None = None) -> nats.NATS:
        """A plain nats-py connection as `user`; permission errors are appended to `errors`."""
        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))
        return await nats.connect(self.url, error_cb=on_error, allow_reconnect=False, connect_timeout=CONNECT_TIMEOUT_S,
                                  **self.options(user))

    async def wait_user(self, user: str, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                nc = await self.raw(user)
                await nc.close()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


def provision(b: SecureBroker) -> None:
    async def go() -> None:
        store = await JetStreamStore.connect(b.url, name="test-admin", **b.options(permissions.ADMIN))
        await store.close()
    asyncio.run(go())


@pytest.fixture
def secure_broker(tmp_path: Path) -> Iterator[SecureBroker]:
    """nats-server with the generated users (node n1), streams provisioned."""
    b = SecureBroker(tmp_path / "secure-nats")
    b.start()
    try:
        provision(b)
        yield b
    finally:
        b.stop()
