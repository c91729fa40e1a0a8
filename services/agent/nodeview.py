"""What the agent tells the fleet it holds ready: a NodeHeartbeat with its free slots and warm standby ranks, each
time either changes: the standby pool says when it does, and ranks starting and exiting are looked for every
WATCH_S (an idle node once showed "free 0" until its pool next changed). Coalesced, so a burst (a restart taking every
standby at once) is one event; an append that fails is left to the next change, since only the newest view matters."""

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable

import structlog

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeHeartbeat
from flightdeck.events.store import EventStore
from flightdeck.services.shell.connection import TRANSIENT

log = structlog.get_logger("flightdeck.agent")
REPORT_AFTER_S = 0.2  # changes within this window make one event
WATCH_S = 1.0  # how often the ranks' count is looked at (an event only when the view moved)


class NodeView:
    def __init__(self, store: EventStore, node: str, producer: str, slots: int, busy: Callable[[], int],
                 standbys: Callable[[], int]) -> None:
        self.store, self.node, self.producer, self.slots = store, node, producer, slots
        self.busy, self.standbys = busy, standbys
        self.sent: tuple[int, int] | None = None
        self.dirty = False
        self.task: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Report the view as it stands, and whenever it moves from now on."""
        self.changed()
        self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if self._view() != self.sent:  # moved, or never recorded yet (an append that failed is tried again)
                self.changed()

    def _view(self) -> tuple[int, int]:
        return max(self.slots - self.busy(), 0), self.standbys()

    def changed(self) -> None:
        self.dirty = True
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._report())

    async def close(self) -> None:
        for task in (self.watcher, self.task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _report(self) -> None:
        while self.dirty:  # a change while the last one was being appended is reported too
            self.dirty = False
            await asyncio.sleep(REPORT_AFTER_S)
            view = self._view()
            if view == self.sent:
                continue
            ev = NodeHeartbeat(node=self.node, free_slots=view[0], standbys=view[1], occurred_at=time.time(),
                               producer=self.producer, event_id=f"{self.producer}:view:{uuid.uuid4().hex[:12]}")
            try:
                await self.store.append(subjects.node(self.node, "NodeHeartbeat"), ev, msg_id=ev.event_id)
            except TRANSIENT as exc:
                log.warning("node view not recorded; the next change reports it", error=repr(exc))
                continue
            self.sent = view
