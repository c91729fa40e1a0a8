"""Events waiting to be published, with a priority drop when full: a rank's before they reach its agent, and the
agent's custody of them until the broker stores them. Heartbeats and steps are superseded by the next of their
kind; the facts a postmortem needs (faults, drills, checkpoints staged, rollbacks, starts) are never dropped."""

import threading
from collections import deque

from flightdeck.events.base import Event, RankEvent
from flightdeck.events.training import Heartbeat, StepCompleted

DROPPABLE: tuple[type[Event], ...] = (Heartbeat, StepCompleted)


class Backlog:
    """Two deques (droppable and kept) tagged with one running sequence: dropping the oldest droppable is O(1),
    taking in emit order is a merge of the heads, and taking kept events first is trivial. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._lock = threading.Lock()
        self._droppable: deque[tuple[int, RankEvent]] = deque()
        self._kept: deque[tuple[int, RankEvent]] = deque()
        self._seq = 0
        self.num_dropped = 0

    def push(self, event: RankEvent) -> None:
        with self._lock:
            self._seq += 1
            (self._droppable if isinstance(event, DROPPABLE) else self._kept).append((self._seq, event))
            # Over capacity with nothing droppable left, a kept event still goes in: losing a fault is worse.
            if len(self._droppable) + len(self._kept) > self.capacity and self._droppable:
                self._droppable.popleft()
                self.num_dropped += 1

    def take(self, n: int, *, kept_first: bool = False) -> list[RankEvent]:
        out: list[RankEvent] = []
        with self._lock:
            d, k = self._droppable, self._kept
            while len(out) < n and (d or k):
                if k and (kept_first or not d or k[0][0] < d[0][0]):
                    out.append(k.popleft()[1])
                else:
                    out.append(d.popleft()[1])
        return out

    def __len__(self) -> int:
        return len(self._droppable) + len(self._kept)

    def count_kept(self) -> int:
        return len(self._kept)
