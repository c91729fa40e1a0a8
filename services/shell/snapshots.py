"""Snapshots of a service's folded state (the design's rule 5), so a restart folds only what came after one.

A snapshot is the state, the positions it was folded to in FD_CONTROL and FD_TELEMETRY, and the admission rule's
memory, taken after an input's outputs were stored. It lives in FD_STATE under the service's own subjects (only that
service's broker user may write them): the state in parts of at most PART_BYTES, two generations apart so a torn
write never replaces a good snapshot, and a head written last that names the generation, the parts' sha256 and the
fingerprint of the code and initial state it was folded by. A snapshot of other code, or one that does not check, is
passed over: the service refolds from the first event, as it always may.

The state is pickled: cores hold plain Python (deques, sets, slotted classes), and only the service that folded it
reads it back. `digest` is a canonical hash of a state, so a test can hold a snapshot equal to a refold.
"""

import asyncio
import contextlib
import hashlib
import inspect
import math
import os
import pickle
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from flightdeck.events import subjects
from flightdeck.events.store import EventStore
from flightdeck.services.core import Service
from flightdeck.services.shell.fold import Folder

log = structlog.get_logger("flightdeck.shell.snapshots")

FORMAT = 1
PART_BYTES = 4 * 1024 * 1024  # under the broker's max_payload (infra/nats/server.conf: 8 MB)
EVERY = 10_000  # inputs folded between two snapshots ($FLIGHTDECK_STATE_SNAPSHOT_EVERY; 0: never)
EVERY_ENV = "FLIGHTDECK_STATE_SNAPSHOT_EVERY"
CLOSE_S = 10.0  # what a stopping service gives its last snapshot
# At most one a minute: taking one holds the service's loop (0.43 s for the health monitor of a 4,096-rank job, whose
# 10,000 inputs come in 1.2 s), so a restart then folds at most a minute's inputs.
MIN_INTERVAL_S = 60.0


def every_setting() -> int:
    raw = os.environ.get(EVERY_ENV, "").strip()
    try:
        value = int(raw) if raw else EVERY
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"${EVERY_ENV} must be a whole number of inputs (0: no snapshots), got {raw!r}")
    return value


class Head(msgspec.Struct, frozen=True, kw_only=True):
    """What names a snapshot: written after its parts."""

    format: int
    service: str
    fingerprint: str
    generation: int
    control_seq: int
    telemetry_seq: int
    versions: dict[str, int]  # the admission rule's newest job_version per job (events/admission.py)
    parts: list[str]  # sha256 of each part, in order
    size: int
    taken_at: float


@dataclass(frozen=True)
class Loaded:
    head: Head
    folder: Folder[Any]


def _sources(service: Service[Any]) -> Iterable[Path]:
    """The code a state was folded by: the core's package, the fold and the event catalog."""
    core = Path(inspect.getfile(sys.modules[service.transition.__module__])).parent
    here = Path(__file__).resolve().parent
    for folder in (core, here.parent.parent / "events"):
        yield from sorted(folder.glob("*.py"))
    yield here.parent / "core.py"
    yield here / "fold.py"


_FINGERPRINTS: dict[str, str] = {}


def fingerprint(service: Service[Any]) -> str:
    """The core's code and its initial state: a snapshot folded by anything else is not used."""
    key = f"{service.name}:{service.transition.__module__}"
    if key not in _FINGERPRINTS:
        h = hashlib.sha256(f"{FORMAT}:{service.name}".encode())
        for path in _sources(service):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        _FINGERPRINTS[key] = h.hexdigest()
    h = hashlib.sha256(_FINGERPRINTS[key].encode())
    h.update(digest(service.initial).encode())
    return h.hexdigest()


def plain(value: Any) -> Any:
    """A canonical, comparable form of a state: structs and slotted objects as sorted fields, sets and dict items
    sorted, a deque with its bound, a NaN as text."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value
    if value is None or isinstance(value, str | int | bytes | bool):
        return value
    if isinstance(value, msgspec.Struct):
        return [type(value).__name__, [(f, plain(getattr(value, f))) for f in value.__struct_fields__]]
    if is_dataclass(value) and not isinstance(value, type):
        return [type(value).__name__, [(f.name, plain(getattr(value, f.name))) for f in fields(value)]]
    if isinstance(value, dict):
        return ["dict", sorted(([plain(k), plain(v)] for k, v in value.items()), key=repr)]
    if isinstance(value, set | frozenset):
        return ["set", sorted((plain(v) for v in value), key=repr)]
    if isinstance(value, deque):
        return ["deque", value.maxlen, [plain(v) for v in value]]
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    slots = [s for klass in type(value).__mro__ for s in getattr(klass, "__slots__", ())]
    if slots:
        return [type(value).__name__, [(s, plain(getattr(value, s, None))) for s in sorted(set(slots))]]
    if hasattr(value, "__dict__"):
        return [type(value).__name__, sorted(((k, plain(v)) for k, v in vars(value).items()), key=repr)]
    return repr(value)


def digest(state: Any) -> str:
    return hashlib.sha256(repr(plain(state)).encode()).hexdigest()


def head_subject(service: str) -> str:
    return f"fd.state.{subjects.token(service)}.head"


def part_subject(service: str, generation: int, index: int) -> str:
    return f"fd.state.{subjects.token(service)}.g{generation % 2}.p{index}"


@dataclass
class Taken:
    """A snapshot made in memory, to write."""

    head: Head
    parts: list[bytes] = field(default_factory=list)


def take(folder: Folder[Any], generation: int, now: float) -> Taken:
    """The folder's state as it is now (synchronous: nothing folds meanwhile)."""
    blob = pickle.dumps(folder.state, protocol=pickle.HIGHEST_PROTOCOL)
    parts = [blob[i:i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)] or [b""]
    head = Head(format=FORMAT, service=folder.service.name, fingerprint=fingerprint(folder.service),
                generation=generation, control_seq=folder.control_seq, telemetry_seq=folder.telemetry_seq,
                versions=dict(folder.admission.versions), parts=[hashlib.sha256(p).hexdigest() for p in parts],
                size=len(blob), taken_at=now)
    return Taken(head, parts)


async def write(store: EventStore, taken: Taken) -> None:
    """Parts first, the head last: until the head is stored, the previous snapshot (the other generation) stands."""
    head = taken.head
    name, gen, tag = head.service, head.generation, f"{head.service}:state:{head.generation}:{head.control_seq}"
    for i, part in enumerate(taken.parts):
        await store.append_bytes(part_subject(name, gen, i), part, msg_id=f"{tag}:{i}")
    await store.append_bytes(head_subject(name), msgspec.msgpack.encode(head), msg_id=tag)


async def load(store: EventStore, service: Service[Any]) -> Loaded | None:
    """The service's newest snapshot as a folder, or None (none, another code's, or one that does not check:
    said in the log). Never raises: without a snapshot the service refolds."""
    try:
        stored = await store.last(subjects.STATE, head_subject(service.name))
        if stored is None:
            return None
        head = msgspec.msgpack.decode(stored.data, type=Head)
        if head.format != FORMAT or head.service != service.name or head.fingerprint != fingerprint(service):
            log.info("state snapshot of other code passed over: refolding", control_seq=head.control_seq)
            return None
        blob = b""
        for i, want in enumerate(head.parts):
            part = await store.last(subjects.STATE, part_subject(service.name, head.generation, i))
            if part is None or hashlib.sha256(part.data).hexdigest() != want:
                raise ValueError(f"part {i} of generation {head.generation} is missing or does not match its head")
            blob += part.data
        state = pickle.loads(blob)  # written by this service's own broker user alone
    except Exception as exc:  # a snapshot only shortens the rebuild
        log.warning("state snapshot unusable: refolding", error=repr(exc))
        return None
    folder: Folder[Any] = Folder(service)
    folder.restore(state, head.control_seq, head.telemetry_seq, head.versions)
    return Loaded(head, folder)


class Saver:
    """Takes a snapshot every `every` inputs a service folds, at most one per `min_interval_s` (and when it stops),
    and writes it in the background, one at a time: a write that fails (the broker away) is given up, and the next
    one comes `every` inputs on."""

    def __init__(self, store: EventStore, every: int, loaded: Loaded | None = None, *,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.store, self.every, self.min_interval_s = store, every, min_interval_s
        self.generation = loaded.head.generation + 1 if loaded is not None else 0
        self.since = 0
        self.taken_at = -math.inf  # time.monotonic() of the last one taken
        self.writing: asyncio.Task[None] | None = None
        self.num_written = 0

    def folded(self, folder: Folder[Any], inputs: int = 1) -> None:
        """After an input's outputs are stored: its state may be snapshotted."""
        self.since += inputs
        if not self.every or self.since < self.every or (self.writing is not None and not self.writing.done()):
            return
        if time.monotonic() - self.taken_at < self.min_interval_s:
            return
        self.taken_at = time.monotonic()
        self.writing = asyncio.create_task(self._write(take(folder, self.generation, time.time())))
        self.since = 0

    async def close(self, folder: Folder[Any]) -> None:
        """At a clean stop: the state as it stands, so the next start folds nothing twice."""
        if self.writing is not None:
            await asyncio.gather(self.writing, return_exceptions=True)
        if self.every and self.since:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await self._write(take(folder, self.generation, time.time()))

    async def _write(self, taken: Taken) -> None:
        began = time.perf_counter()
        try:
            await write(self.store, taken)
        except Exception as exc:
            log.warning("state snapshot not written", control_seq=taken.head.control_seq, error=repr(exc))
            return
        self.num_written += 1
        self.generation = taken.head.generation + 1  # a failed write's generation is written again: the good one stays
        log.info("state snapshot written", control_seq=taken.head.control_seq, bytes=taken.head.size,
                 seconds=round(time.perf_counter() - began, 3))
