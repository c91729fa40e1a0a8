"""The simulated broker: an in-memory store with JetStream's sequences and de-duplication (events.store.MemoryStore,
on the simulated clock) and durable consumers as the shell configures them (one input in flight, redelivered until
acked or given up after `max_deliver`), whose positions a broker restart can set back and whose replies can be stale.
"""

from dataclasses import dataclass, field

from flightdeck.events import subjects
from flightdeck.events.store import MemoryStore, Stored

MAX_DELIVER = 5  # the shell's default (ConsumerPolicy.max_deliver)


@dataclass
class Consumer:
    filters: tuple[str, ...]
    done: set[int] = field(default_factory=set)  # acked, terminated or given up
    deliveries: dict[int, int] = field(default_factory=dict)
    flushed: set[int] = field(default_factory=set)  # `done` as the broker's disk last held it
    scan_from: int = 0  # no message before this index is undone (done only grows between restarts)

    def floor(self, messages: list[Stored]) -> int:
        """The ack floor: the last matching message before the first one not done."""
        floor = 0
        for s in messages:
            if not subjects.matches_any(self.filters, s.subject):
                continue
            if s.seq not in self.done:
                break
            floor = s.seq
        return floor


class SimBroker:
    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.consumers: dict[str, Consumer] = {}
        self.num_restarts = 0

    def messages(self) -> list[Stored]:
        return self.store.rows(subjects.CONTROL)

    def telemetry(self) -> list[Stored]:
        return self.store.rows(subjects.TELEMETRY)

    def consumer(self, name: str, filters: tuple[str, ...]) -> Consumer:
        """Create or update a durable consumer (its position is kept, as JetStream keeps it)."""
        c = self.consumers.get(name)
        if c is None:
            c = self.consumers[name] = Consumer(filters)
        c.filters, c.scan_from = filters, 0
        return c

    def deliver(self, name: str) -> tuple[Stored | None, Stored | None]:
        """(the next input for `name`, an input just given up on); redelivers the one in flight until it is done."""
        c = self.consumers[name]
        messages = self.messages()
        for i in range(c.scan_from, len(messages)):
            s = messages[i]
            if s.seq in c.done or not subjects.matches_any(c.filters, s.subject):
                if i == c.scan_from:
                    c.scan_from = i + 1
                continue
            n = c.deliveries.get(s.seq, 0)
            if n >= MAX_DELIVER:
                c.done.add(s.seq)
                return None, s
            c.deliveries[s.seq] = n + 1
            return s, None
        return None, None

    def deliver_peek(self, name: str) -> Stored | None:
        """The input `deliver` would hand over next, without counting a delivery."""
        c = self.consumers[name]
        messages = self.messages()
        for i in range(c.scan_from, len(messages)):
            s = messages[i]
            if s.seq not in c.done and subjects.matches_any(c.filters, s.subject):
                return s
        return None

    def finish(self, name: str, seq: int) -> None:
        """An ack (or a term: the server forgets the input either way)."""
        self.consumers[name].done.add(seq)

    def floor(self, name: str, *, stale: bool = False) -> int:
        """The consumer's ack floor; `stale`: as its state on disk said it (a reply right after a restart)."""
        c = self.consumers[name]
        if stale:
            return Consumer(c.filters, done=set(c.flushed)).floor(self.messages())
        return c.floor(self.messages())

    def flush(self) -> None:
        """The consumers' state reaches the broker's disk."""
        for c in self.consumers.values():
            c.flushed = set(c.done)

    def restart(self) -> None:
        """A SIGKILL and restart on the same store: the stream is whole (sync_interval: always), consumer
        positions are what was last flushed, and nothing is in flight."""
        self.num_restarts += 1
        for c in self.consumers.values():
            c.done = set(c.flushed)
            c.deliveries = {}
            c.scan_from = 0
