"""The broker connection a service holds: reconnects forever, and remembers the subjects the broker
refused to let it publish to (nats-py reports such a publish as a timeout; only the connection's
error callback sees "permissions violation")."""

import asyncio
import contextlib

import nats.errors
import nats.js.errors
import structlog

from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.store import StoreUnavailable
from flightdeck.services.shell.security.credentials import check_url, client_options

log = structlog.get_logger("flightdeck.shell")

# What a broker going away looks like from nats-py: retried with backoff, never fatal.
TRANSIENT: tuple[type[BaseException], ...] = (
    StoreUnavailable, nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError, nats.errors.FlushTimeoutError,
    nats.errors.ConnectionReconnectingError, nats.js.errors.ServiceUnavailableError, asyncio.TimeoutError,
    ConnectionError, OSError,
)


class PublishDenied(RuntimeError):
    def __init__(self, subject: str) -> None:
        super().__init__(f"the broker denied this service permission to publish to {subject!r}: "
                         "grant it in the service's NATS user (infra/nats), then restart the service")
        self.subject = subject


class Connection:
    """A NATS connection that reconnects forever and remembers which subjects the broker refused."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.denied: set[str] = set()  # lower-cased: nats-py lower-cases the server's -ERR text
        self.closing = False  # set before a deliberate close, which nats-py also reports as a disconnect

    async def _error(self, exc: Exception) -> None:
        text = str(exc)
        if "permissions violation" in text.lower():
            self.denied.add(text.rsplit(" to ", 1)[-1].strip().strip('"').lower())
            log.error("broker denied permission", error=text)
        else:
            log.warning("nats error", error=text)

    async def _disconnected(self) -> None:
        if not self.closing:
            log.warning("disconnected from broker; reconnecting")

    async def _reconnected(self) -> None:
        log.info("reconnected to broker")

    async def open(self, url: str, stop: asyncio.Event) -> JetStreamStore | None:
        """Connect and provision the streams, retrying until the broker answers (None: stopped first).
        Credentials and TLS come from files named in the environment (services/shell/security/credentials.py)."""
        check_url(url)
        delay = 0.2
        while not stop.is_set():
            try:
                return await JetStreamStore.connect(
                    url, name=f"flightdeck-{self.service}", error_cb=self._error,
                    disconnected_cb=self._disconnected, reconnected_cb=self._reconnected, **client_options(),
                )
            except TRANSIENT as exc:
                if self.denied:  # e.g. streams missing and this user may not create them: waiting will not help
                    raise PublishDenied(sorted(self.denied)[0]) from exc
                log.warning("broker unreachable; retrying", url=url, error=repr(exc), retry_in_s=delay)
                await sleep_or_stop(stop, delay)
                delay = min(delay * 2, 5.0)
        return None

    def is_denied(self, subject: str) -> bool:
        return subject.lower() in self.denied


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):  # not wait_for: it can swallow a cancel on 3.11 (gh-86296)
            await stop.wait()
