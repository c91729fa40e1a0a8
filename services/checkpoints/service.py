"""The checkpoint service as a running service: the pure core (core.py) bound to an object store.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from flightdeck.services.checkpoints import uploader
from flightdeck.services.checkpoints.core import COMMIT, DELETE, SCRUB, core_service
from flightdeck.services.checkpoints.state import Settings, State
from flightdeck.services.core import EffectHandler, Emit, Service
from flightdeck.services.shell.objects.open import objects_url, open_store
from flightdeck.services.shell.objects.store import ObjectStore

SCRUB_EVERY_ENV = "FLIGHTDECK_SCRUB_EVERY_S"  # re-verify each committed checkpoint this often; 0 turns scrubs off
SCRUB_MB_S_ENV = "FLIGHTDECK_SCRUB_MB_S"  # the scrubber's read rate bound
DEFAULT_SCRUB_EVERY_S = 86_400.0


class _OpenOnFirstUse:
    """Effect handlers that open the object store the first time one of them runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._stack = contextlib.AsyncExitStack()
        self._handlers: dict[str, EffectHandler] | None = None

    async def _get(self) -> dict[str, EffectHandler]:
        if self._handlers is None:
            store: ObjectStore = await self._stack.enter_async_context(open_store(self.url))
            self._handlers = uploader.handlers(store)
        return self._handlers

    def handler(self, kind: str) -> EffectHandler:
        async def run(args: Any) -> list[Emit]:
            return list(await (await self._get())[kind](args))

        return run


def build(env: Mapping[str, str] | None = None) -> Service[State]:
    env = os.environ if env is None else env
    lazy = _OpenOnFirstUse(objects_url(env))
    return core_service({kind: lazy.handler(kind) for kind in (COMMIT, DELETE, SCRUB)},
                        scrub_every_s=float(env.get(SCRUB_EVERY_ENV) or DEFAULT_SCRUB_EVERY_S),
                        scrub_mb_s=float(env.get(SCRUB_MB_S_ENV) or Settings().scrub_mb_s))
