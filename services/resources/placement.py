"""Where a job's ranks go: topology-aware, gang (all slots or none), pure.

Why it works this way: docs/internals.md, "4. Resources and the resharder".
"""

from collections.abc import Sequence
from dataclasses import dataclass

from flightdeck.events.job import SlotRef


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node placement may use: its free slot ids and whether it is a spare."""

    node: str
    free: tuple[int, ...]
    spare: bool = False


@dataclass(frozen=True, slots=True)
class Unplaceable:
    reason: str


def place(candidates: Sequence[Candidate], slots: int, *, tp: int = 1,
          use_spares: bool = False) -> tuple[SlotRef, ...] | Unplaceable:
    """Exactly `slots` assignments with ranks 0..slots-1, or why the job cannot be placed now."""
    if slots < 1 or tp < 1 or slots % tp:
        return Unplaceable(f"cannot split {slots} slots into tensor-parallel groups of {tp}")
    regular = [c for c in candidates if not c.spare]
    placed = _fit(regular, slots // tp, tp)
    if placed is None and use_spares:
        placed = _fit(list(candidates), slots // tp, tp)
    if placed is not None:
        return placed
    pool = candidates if use_spares else regular
    groups = sum(len(c.free) // tp for c in pool)
    return Unplaceable(f"needs {slots // tp} groups of {tp} slot(s); the usable nodes have room for {groups}"
                       f" ({sum(len(c.free) for c in pool)} free slots on {len(pool)} nodes"
                       f"{'' if use_spares else ', spares excluded'})")


def min_nodes(capacities: Sequence[int], groups: int) -> int:
    """The fewest nodes whose group capacities add up to `groups` (0 if they cannot)."""
    total = 0
    for count, cap in enumerate(sorted(capacities, reverse=True), start=1):
        total += cap
        if total >= groups:
            return count
    return 0


def _fit(nodes: list[Candidate], groups: int, tp: int) -> tuple[SlotRef, ...] | None:
    usable = [c for c in nodes if len(c.free) // tp > 0]
    if sum(len(c.free) // tp for c in usable) < groups:
        return None
    largest = sorted(usable, key=lambda c: (-(len(c.free) // tp), c.node))
    k = min_nodes([len(c.free) // tp for c in usable], groups)
    chosen = largest[: k - 1]
    remainder = groups - sum(len(c.free) // tp for c in chosen)
    last = min((c for c in largest[k - 1:] if len(c.free) // tp >= remainder), key=lambda c: (len(c.free), c.node))
    refs: list[SlotRef] = []
    left = groups
    for c in [*chosen, last]:
        take = min(len(c.free) // tp, left) * tp
        base = len(refs)
        refs.extend(SlotRef(node=c.node, slot=s, rank=base + i) for i, s in enumerate(sorted(c.free)[:take]))
        left -= take // tp
    assert left == 0 and len(refs) == groups * tp
    return tuple(refs)
