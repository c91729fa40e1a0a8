"""The allocation ledger: which job (and attempt) holds each slot. A slot has at most one holder, ever.

Values are frozen; every operation returns a new ledger. `book` asserts the slots are free, because
a double booking is a bug in placement, not a condition to handle: placement only offers free slots.
"""

from collections.abc import Iterable

import msgspec

from flightdeck.events.job import SlotRef


class Allocation(msgspec.Struct, frozen=True, kw_only=True):
    attempt: int
    assignments: tuple[SlotRef, ...]
    master_port: int = 0  # where its rank 0 listens for the rendezvous (0: not recorded)
    snapshot_need: int = 0  # what each of its ranks takes of a node's snapshot memory (events/snapshot.py)
    snapshots_off: dict[str, str] = {}  # nodes whose ranks of it take no snapshots, and why

    @property
    def rank0_node(self) -> str:
        return next((r.node for r in self.assignments if r.rank == 0), "")


class Ledger(msgspec.Struct, frozen=True, kw_only=True):
    allocations: dict[str, Allocation] = {}  # job id -> what it holds
    taken: dict[str, dict[int, str]] = {}  # node -> slot -> job id; the same facts, indexed by node


def holder(ledger: Ledger, node: str, slot: int) -> str | None:
    return ledger.taken.get(node, {}).get(slot)


def free_slots(ledger: Ledger, node: str, slots: int) -> tuple[int, ...]:
    """Slot ids 0..slots-1 of `node` that nobody holds, lowest first."""
    taken = ledger.taken.get(node, {})
    return tuple(s for s in range(slots) if s not in taken)


def snapshot_used(ledger: Ledger, node: str) -> int:
    """What the ranks booked on `node` take of its snapshot memory."""
    return sum(a.snapshot_need * sum(1 for r in a.assignments if r.node == node)
               for a in ledger.allocations.values() if node not in a.snapshots_off)


def book(ledger: Ledger, job_id: str, attempt: int, assignments: Iterable[SlotRef], master_port: int = 0, *,
         snapshot_need: int = 0, snapshots_off: dict[str, str] | None = None) -> Ledger:
    """Give `assignments` to `job_id`. The job must hold nothing and every slot must be free."""
    refs = tuple(assignments)
    assert job_id not in ledger.allocations, f"{job_id} already holds slots; release them first"
    taken = dict(ledger.taken)
    for node in {ref.node for ref in refs}:
        taken[node] = dict(taken.get(node, {}))  # copy only the nodes this booking touches
    for ref in refs:
        current = taken[ref.node].get(ref.slot)
        assert current is None, f"slot {ref.node}/{ref.slot} is held by {current}; {job_id} cannot have it"
        taken[ref.node][ref.slot] = job_id
    held = Allocation(attempt=attempt, assignments=refs, master_port=master_port, snapshot_need=snapshot_need,
                      snapshots_off=snapshots_off or {})
    allocations = {**ledger.allocations, job_id: held}
    return Ledger(allocations=allocations, taken=taken)


def release(ledger: Ledger, job_id: str, attempt: int | None = None) -> Ledger:
    """Free what `job_id` holds; with `attempt`, only if it holds that attempt (a late release of an
    older attempt must not free a newer one). Releasing what is not held changes nothing."""
    held = ledger.allocations.get(job_id)
    if held is None or (attempt is not None and held.attempt != attempt):
        return ledger
    nodes = {ref.node for ref in held.assignments}
    taken = dict(ledger.taken)
    for node in nodes:
        left = {slot: job for slot, job in taken[node].items() if job != job_id}
        if left:
            taken[node] = left
        else:
            del taken[node]
    allocations = {job: a for job, a in ledger.allocations.items() if job != job_id}
    return Ledger(allocations=allocations, taken=taken)
