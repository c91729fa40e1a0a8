"""A rank's host snapshot in shared memory, as both sides of the node read it: the rank writes it
(trainer/snapshots.py), its node agent persists it when the rank is gone and points a restarted rank at it
(services/agent/snapshots.py). No torch here: the agent reads the header and checks the bytes with zlib.

One segment per rank, two slots, written in turn: `<root>/<job>/a<attempt>-r<rank>-s<slot>/` holds
`r<rank>.bin` (the tensors' bytes, each at its own offset) and `r<rank>.json` (this header). A slot is being
written while its header is absent: the rank removes it first and writes it last (a rename), so a rank killed
mid-copy leaves a slot without a header, never one whose header describes other bytes; the checksum of every item
catches what that cannot (a segment edited or rotting in place).

The same two files, uploaded, are a committed checkpoint's shards: a set persisted from memory is restored from
the store by the same reader as from memory."""

import os
import zlib
from pathlib import Path

import msgspec
import xxhash

from flightdeck.events.checkpoint import DataPosition

FORMAT = "flightdeck-snapshot/2"  # items summed with xxh3_64, ~5x faster than zlib's crc32 on the same bytes
FORMAT_CRC32 = "flightdeck-snapshot/1"  # items summed with zlib's crc32: sets persisted by earlier versions
SLOTS = 2
MARGIN = 1.25  # a node's snapshot memory must hold a rank's two slots with this much to spare
HEADER_BYTES_MAX = 64 << 20  # a header holds the items' table and the packed extras: larger is not ours
Buffer = bytes | bytearray | memoryview
SNAPSHOTS_ENV = "FLIGHTDECK_SNAPSHOTS"  # the node's snapshot root (on tmpfs), set by the agent for its ranks
SNAPSHOTS_OFF_ENV = "FLIGHTDECK_SNAPSHOTS_OFF"  # why they take none: the grant found no room (AllocationGranted)
RECENT_STEPS = 64  # step reports a header carries (Header.steps)


def rank_need(snapshot_bytes: int) -> int:
    """What one rank's two slots take of its node's snapshot memory, with the margin."""
    return int(SLOTS * snapshot_bytes * MARGIN)


class Item(msgspec.Struct, frozen=True, kw_only=True):
    """One saved item. A tensor's bytes are in the .bin at `at`; its chunk of the global tensor is `offsets` and
    `sizes` (the whole tensor unless it is a DTensor's shard). Anything else is `packed` (torch.save's bytes)."""

    key: str
    digest: int = 0  # xxh3_64 of the item's bytes (format 2)
    crc32: int = 0  # zlib's crc32 of them (format 1)
    dtype: str = ""  # torch dtype name without "torch.": a tensor
    shape: list[int] = []  # the global tensor's
    offsets: list[int] = []
    sizes: list[int] = []
    at: int = 0
    nbytes: int = 0
    packed: bytes = b""  # not a tensor: msgspec's JSON carries it as base64


class Header(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    job_id: str
    attempt: int
    rank: int
    world_size: int
    step: int  # the state before step `step` runs, as checkpoint step-N holds it
    timeline: int  # rollbacks the attempt had applied (events/checkpoint.checkpoint_id)
    data: DataPosition
    # The rank had begun a checkpoint of this step itself: that set is the step's, a persist of this one never is
    # (a checkpoint id names one set).
    checkpointing: bool
    replicated: bool  # every tensor is a full replica (plain data parallel): any rank's holds the model's state
    bin_bytes: int
    items: list[Item]
    # DP, TP, PP of the layout the rank ran (its run.plan): a sharded slot restores only into the same layout;
    # [] from a trainer before layouts were recorded
    layout: list[int] = []
    # The rank's newest StepCompleted events (msgpack: a NaN loss survives) as it had sent them when it took the
    # snapshot. An agent persisting the slot past the rank's record publishes the missing ones again under their
    # own ids, so the history never resumes past a step it holds no record of (they died in transit with an agent).
    steps: list[bytes] = []


class BadSnapshot(ValueError):
    """A slot that cannot be trusted: torn, edited, of another job, rank or attempt."""


def slot_dir(root: Path, job_id: str, attempt: int, rank: int, slot: int) -> Path:
    return root / job_id / f"a{attempt}-r{rank}-s{slot}"


def bin_name(rank: int) -> str:
    return f"r{rank}.bin"


def header_name(rank: int) -> str:
    return f"r{rank}.json"


def read_header(path: Path) -> Header:
    """The header at `path` (size-capped, decoded and typed), or BadSnapshot saying why not."""
    try:
        with path.open("rb") as f:
            raw = f.read(HEADER_BYTES_MAX + 1)
    except OSError as exc:
        raise BadSnapshot(f"snapshot header {path}: {exc}") from None
    if len(raw) > HEADER_BYTES_MAX:
        raise BadSnapshot(f"snapshot header {path} is larger than {HEADER_BYTES_MAX} bytes")
    try:
        header = msgspec.json.decode(raw, type=Header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadSnapshot(f"snapshot header {path}: {exc}") from None
    if header.format not in (FORMAT, FORMAT_CRC32):
        raise BadSnapshot(f"snapshot header {path} is {header.format!r}, not {FORMAT!r}")
    return header


def digest(data: Buffer) -> int:
    """An item's checksum as this version writes it."""
    return xxhash.xxh3_64_intdigest(data)


def matches(header: Header, item: Item, data: Buffer) -> bool:
    """Whether `data` are the bytes `item` was summed over, by its header's format."""
    if header.format == FORMAT_CRC32:
        return zlib.crc32(data) == item.crc32
    return xxhash.xxh3_64_intdigest(data) == item.digest


def check_bytes(folder: Path, header: Header) -> None:
    """Every tensor's bytes in the slot's .bin match the header's checksums (BadSnapshot says which do not)."""
    path = folder / bin_name(header.rank)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if size < header.bin_bytes:
                raise BadSnapshot(f"snapshot {path} has {size} bytes, its header says {header.bin_bytes}")
            for item in header.items:
                if item.packed or item.nbytes == 0:
                    if not matches(header, item, item.packed):
                        raise BadSnapshot(f"snapshot {folder}: item {item.key!r} does not match its checksum")
                    continue
                if item.at < 0 or item.at + item.nbytes > size:
                    raise BadSnapshot(f"snapshot {folder}: item {item.key!r} lies outside {path}")
                f.seek(item.at)
                if not matches(header, item, f.read(item.nbytes)):
                    raise BadSnapshot(f"snapshot {folder}: item {item.key!r} does not match its checksum (torn or "
                                      "changed after it was taken)")
    except OSError as exc:
        raise BadSnapshot(f"snapshot {path}: {exc}") from None


def complete_slots(root: Path, job_id: str, attempt: int, rank: int) -> list[tuple[Header, Path]]:
    """The slots of (job, attempt, rank) under `root` whose header reads and names them, newest step first.
    Their bytes are not checked here (check_bytes)."""
    found = []
    for slot in range(SLOTS):
        folder = slot_dir(root, job_id, attempt, rank, slot)
        if not (folder / header_name(rank)).is_file():
            continue
        try:
            header = read_header(folder / header_name(rank))
        except BadSnapshot:
            continue
        if (header.job_id, header.attempt, header.rank) == (job_id, attempt, rank):
            found.append((header, folder))
    return sorted(found, key=lambda hf: (hf[0].timeline, hf[0].step), reverse=True)


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize
