"""What the agent tells the fleet it holds: a NodeHeartbeat with its free slots, warm standby ranks and what its
ranks' snapshots hold in its memory, each time one changes: the standby pool says when it does; ranks starting and
exiting, and the snapshots' bytes, are looked at every WATCH_S (an idle node once showed "free 0" until its pool
next changed). Coalesced, so a burst (a restart taking every
standby at once) is one event; an append that fails is left to the next change, since only the newest view matters."""

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import structlog

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeHeartbeat
from flightdeck.events.store import EventStore
from flightdeck.services.shell.connection import TRANSIENT

log = structlog.get_logger("flightdeck.agent")
REPORT_AFTER_S = 0.2  # changes within this window make one event
WATCH_S = 1.0  # how often the ranks' count is looked at (an event only when the view moved)


def coarse(n: int) -> int:
    """`n` bytes rounded down to its top five bits (within 1/16th), at least a MiB's worth: a snapshot's slots are
    rewritten in place every step, so what they hold moves by a few pages, and a view that moves is an event."""
    if n <= 0:
        return 0 if n == 0 else -1
    step = max(2**20, 2 ** max(n.bit_length() - 5, 0))
    return n // step * step


def held_bytes(root: Path | None) -> int:
    """What the snapshots under `root` hold (blocks, not apparent sizes), -1 with snapshots off."""
    if root is None:
        return -1
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


class NodeView:
    def __init__(self, store: EventStore, node: str, producer: str, slots: int, busy: Callable[[], int],
                 standbys: Callable[[], int], snapshots: Path | None = None) -> None:
        self.store, self.node, self.producer, self.slots = store, node, producer, slots
        self.busy, self.standbys, self.snapshots = busy, standbys, snapshots
        self.held = -1 if snapshots is None else 0  # as last measured (every WATCH_S, off the loop)
        self.sent: tuple[int, int, int] | None = None
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
            with contextlib.suppress(OSError):  # a file removed while it was counted: counted again next time
                self.held = coarse(await asyncio.to_thread(held_bytes, self.snapshots))
            if self._view() != self.sent:  # moved, or never recorded yet (an append that failed is tried again)
                self.changed()

    def _view(self) -> tuple[int, int, int]:
        return max(self.slots - self.busy(), 0), self.standbys(), self.held

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
            ev = NodeHeartbeat(node=self.node, free_slots=view[0], standbys=view[1], snapshot_held=view[2],
                               occurred_at=time.time(), producer=self.producer,
                               event_id=f"{self.producer}:view:{uuid.uuid4().hex[:12]}", schema_version=3)
            try:
                await self.store.append(subjects.node(self.node, "NodeHeartbeat"), ev, msg_id=ev.event_id)
            except TRANSIENT as exc:
                log.warning("node view not recorded; the next change reports it", error=repr(exc))
                continue
            self.sent = view
