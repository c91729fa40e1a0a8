"""How a command reaches the event store: one place that turns "no broker" into a one-line error."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.store import StoreUnavailable
from flightdeck.events.streams import BrokerRefused
from flightdeck.services.shell.security.credentials import CredentialsError, client_options
from flightdeck.services.tools.cli import UserError, unreachable

CONNECT_TIMEOUT_S = 3.0


async def connect(url: str) -> JetStreamStore:
    """Connect and make sure the streams exist (JetStreamStore provisions them idempotently)."""
    try:
        return await JetStreamStore.connect(url, name="flightdeck-cli", request_timeout_s=CONNECT_TIMEOUT_S,
                                            disconnected_cb=_quiet, error_cb=_ignore, **client_options())
    except StoreUnavailable:
        raise unreachable(url) from None
    except (BrokerRefused, CredentialsError) as exc:
        raise UserError(str(exc)) from None


@asynccontextmanager
async def open_store(url: str) -> AsyncIterator[JetStreamStore]:
    store = await connect(url)
    try:
        yield store
    finally:
        await store.close()


async def _quiet() -> None:
    """A command's own close disconnects too; that is no warning for the person reading the output."""


async def _ignore(exc: Exception) -> None:
    """Connection errors surface as the one-line `unreachable` message, not a warning per attempt."""
