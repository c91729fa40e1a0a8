"""When `up` may call its services ready: each one's durable consumer has a pull request waiting,
which a service only sends once it has connected, rebuilt its state and started reading."""

from collections.abc import Iterable

import nats
from nats.js.errors import NotFoundError

from flightdeck.events.jsreader import cancellable, is_unavailable
from flightdeck.events.subjects import CONTROL
from flightdeck.services.shell.runtime import consumer_name
from flightdeck.services.shell.security.credentials import client_options


async def listening(url: str, names: Iterable[str]) -> set[str]:
    """The services among `names` that are reading now; none while the broker does not answer."""

    async def quiet(exc: Exception) -> None:
        """The caller polls; a failed poll is no news worth logging."""

    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0,
                                error_cb=quiet, **client_options())
    except Exception as exc:
        if is_unavailable(exc):
            return set()
        raise
    try:
        js = nc.jetstream(timeout=2)
        found = set()
        for name in names:
            try:
                info = await cancellable(js.consumer_info(CONTROL, consumer_name(name)))
            except NotFoundError:
                continue
            if info.num_waiting:
                found.add(name)
        return found
    finally:
        await nc.close()
