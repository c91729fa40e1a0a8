"""The resource manager's pure core: node inventory, cordons, the allocation ledger, placement.

Why it works this way: docs/internals.md, "4. Resources and the resharder".
"""

import zlib
from typing import Literal

import msgspec

from flightdeck.events import snapshot, subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointFailed, CheckpointScrubbed
from flightdeck.events.clock import CoreConfigured
from flightdeck.events.fleet import (
    NodeCordoned,
    NodeLost,
    NodeRegistered,
    NodeUncordoned,
    SelfCheckFailed,
    SelfCheckPassed,
)
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    SlotRef,
)
from flightdeck.services.core import Emit, Service
from flightdeck.services.resources import ledger as ledger_mod
from flightdeck.services.resources.ledger import Ledger
from flightdeck.services.resources.placement import Candidate, Unplaceable, place

NAME = "resources"


class Node(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["cpu", "gpu"] = "cpu"
    slots: int = 0
    spare: bool = False
    address: str = "127.0.0.1"
    cordoned: bool = False
    cordon_reason: str = ""
    lost: bool = False
    snapshot_bytes: int = -1  # its snapshot memory (NodeRegistered); -1: not reported, so not accounted
    unreached: int = 0  # its reports of stored shards the store contradicted since it registered (Settings.writers)


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What the core decides with: recorded by the shell as CoreConfigured and folded from it."""

    # MASTER_PORT range: a new attempt gets a different port, so a restart never meets its old rendezvous
    base: int = 29500
    span: int = 1000
    # "named": a denial names the nodes placement could not use and why (cordoned: the cordon's reason; lost), so a
    # job waiting for slots says what holds it (issue 51: one sat in `recovering` for 10 minutes saying "0 free
    # slots on 0 nodes"); "counts" for histories recorded before, so that they still verify.
    denials: Literal["counts", "named"] = "counts"
    # "judged": a node whose agent reported shards stored that the store does not hold (CheckpointFailed.node, the
    # checkpoint service's read) UNREACHED_AFTER times since it registered is cordoned `store: ...` (its writes go
    # elsewhere: a wrong mount or bucket); "trusted" for histories recorded before, so that they still verify.
    writers: Literal["trusted", "judged"] = "trusted"

    def __post_init__(self) -> None:
        if not (1024 <= self.base <= 65535 and 1 <= self.span <= 65536 - self.base):
            raise ValueError(f"no such MASTER_PORT range: base {self.base}, span {self.span}")


class State(msgspec.Struct, frozen=True, kw_only=True):
    nodes: dict[str, Node] = {}
    ledger: Ledger = Ledger()
    settings: Settings = Settings()  # recorded as CoreConfigured, folded from it


def master_port(job_id: str, attempt: int, ports: Settings, used: frozenset[int] = frozenset()) -> int:
    """The first port from the job's own place in the range that no other live job's rank 0 on the same node
    holds (`used`); a full range falls back to that place."""
    # crc32, not hash(): Python salts str hashes per process, and a replay must pick the same port.
    start = zlib.crc32(f"{job_id}:{attempt}".encode()) % ports.span
    for i in range(ports.span):
        port = ports.base + (start + i) % ports.span
        if port not in used:
            return port
    return ports.base + start


def ports_in_use(ledger: Ledger, node: str) -> frozenset[int]:
    return frozenset(a.master_port for a in ledger.allocations.values() if a.rank0_node == node and a.master_port)


def candidates(state: State) -> list[Candidate]:
    """Nodes placement may use now, with their free slots."""
    return [Candidate(node=name, free=ledger_mod.free_slots(state.ledger, name, node.slots), spare=node.spare)
            for name, node in sorted(state.nodes.items()) if not node.cordoned and not node.lost]


UNUSABLE_SHOWN = 3  # nodes a denial names, each with its reason cut to REASON_SHOWN characters
REASON_SHOWN = 120


def _unusable(state: State) -> str:
    """The nodes placement could not use and why, for a denial: "; not usable: n1 (lost: ...), n2 (store: ...)"."""
    out = [f"{name} ({node.cordon_reason[:REASON_SHOWN] or ('lost' if node.lost else 'cordoned')})"
           for name, node in sorted(state.nodes.items()) if node.cordoned or node.lost]
    if not out:
        return ""
    more = f" and {len(out) - UNUSABLE_SHOWN} more" if len(out) > UNUSABLE_SHOWN else ""
    return f"; not usable: {', '.join(out[:UNUSABLE_SHOWN])}{more}"


def _node_emit(event: Event, node: str) -> Emit:
    return Emit(subjects.node(node, type(event).__name__), event)


def _job_emit(event: AllocationGranted | AllocationDenied) -> Emit:
    return Emit(subjects.job(event.job_id, type(event).__name__), event)


Transition = tuple[State, tuple[Emit, ...]]


def _with_node(state: State, name: str, **changes: object) -> State:
    node = msgspec.structs.replace(state.nodes.get(name, Node()), **changes)
    return msgspec.structs.replace(state, nodes={**state.nodes, name: node})


def _cordon(state: State, name: str, reason: str, *, lost: bool = False) -> Transition:
    """Cordon on a self-check failure or a loss, recorded as a NodeCordoned unless already cordoned."""
    before = state.nodes.get(name, Node())
    changes: dict[str, object] = {"lost": True} if lost else {}
    if before.cordoned:
        return _with_node(state, name, **changes), ()
    after = _with_node(state, name, cordoned=True, cordon_reason=reason, **changes)
    return after, (_node_emit(NodeCordoned(node=name, reason=reason), name),)


LOST_CORDON = "lost: "  # the reason prefix of the cordon a NodeLost puts on
BLIND_CORDON = "store: "  # ... and of the one a node's failed read of an intact checkpoint puts on
LIFTED_ON_RETURN = (LOST_CORDON, BLIND_CORDON)  # cordons a registration again with a passed self-check lifts


def _blind(state: State, ev: CheckpointScrubbed) -> Transition:
    """A node claimed a checkpoint bad and the checkpoint service read it back intact: the node cannot read what
    the store holds (a missing mount, wrong credentials, another store), so it restores nothing until it is fixed."""
    if not ev.claim_node or ev.cause or ev.claim_node not in state.nodes:
        return state, ()
    return _cordon(state, ev.claim_node,
                   f"{BLIND_CORDON}could not read checkpoint {ev.checkpoint_id} of job {ev.job_id}, which the "
                   f"checkpoint service read back intact from the store ({ev.claim_cause[:300]})")


UNREACHED_AFTER = 2  # one contradiction may be a write lost in flight; two since its registration are the node's


def _unreached(state: State, ev: CheckpointFailed) -> Transition:
    """The store (read by the checkpoint service) contradicts a node's report that it stored a set's shards: after
    UNREACHED_AFTER such since it registered, the node is the suspect, cordoned until it registers again with a
    passed self-check (a fixed mount); the job's own incident (CheckpointsFailing) is the checkpoint service's."""
    node = state.nodes.get(ev.node)
    if state.settings.writers != "judged" or node is None:
        return state, ()
    state = _with_node(state, ev.node, unreached=node.unreached + 1)
    if node.unreached + 1 < UNREACHED_AFTER or node.cordoned:
        return state, ()
    return _cordon(state, ev.node, f"{BLIND_CORDON}its agent reported shards stored that the store does not hold, "
                                   f"{node.unreached + 1} times since it registered ({ev.reason[:300]})")


def _back(state: State, name: str) -> Transition:
    """A node found lost whose agent registered again and passed its self-check is usable again: the loss cordon
    (and only that one: an operator's or a failed self-check's stays) is lifted, recorded as NodeUncordoned. An
    agent restarted on a healthy host (an upgrade, a crash) thus costs its ranks, never the node."""
    node = state.nodes.get(name)
    if node is None or not node.cordoned or not node.cordon_reason.startswith(LIFTED_ON_RETURN):
        return state, ()
    reason = f"registered again after it was {node.cordon_reason[:200]}; its self-check passed"
    after = _with_node(state, name, cordoned=False, cordon_reason="")
    return after, (_node_emit(NodeUncordoned(node=name, reason=reason), name),)


def _allocate(state: State, ev: AllocationRequested) -> Transition:
    ports = state.settings
    held = state.ledger.allocations.get(ev.job_id)
    if held is not None and held.attempt == ev.attempt and len(held.assignments) == ev.slots:
        port = held.master_port or master_port(ev.job_id, ev.attempt, ports)
        granted = _grant(state, ev, held.assignments, port, held.snapshots_off)  # the same answer
        return state, (_job_emit(granted),)
    if held is not None and held.attempt >= ev.attempt:
        why = (f"attempt {ev.attempt} is stale: attempt {held.attempt} holds slots" if held.attempt > ev.attempt
               else f"attempt {ev.attempt} already holds {len(held.assignments)} slots, not {ev.slots}")
        denied = AllocationDenied(job_id=ev.job_id, attempt=ev.attempt, reason=why)
        return state, (_job_emit(denied),)
    # A job runs one attempt at a time: asking for a newer one gives back what an older one held.
    base = msgspec.structs.replace(state, ledger=ledger_mod.release(state.ledger, ev.job_id))
    placed = place(candidates(base), ev.slots, tp=ev.tp, use_spares=ev.use_spares)
    if isinstance(placed, Unplaceable):
        why = placed.reason + (_unusable(base) if state.settings.denials == "named" else "")
        denied = AllocationDenied(job_id=ev.job_id, attempt=ev.attempt, reason=why)
        return base, (_job_emit(denied),)
    rank0 = next(r.node for r in placed if r.rank == 0)
    port = master_port(ev.job_id, ev.attempt, ports, ports_in_use(base.ledger, rank0))
    need = snapshot.rank_need(ev.snapshot_bytes)
    off = snapshots_off(base, placed, need)
    booked = ledger_mod.book(base.ledger, ev.job_id, ev.attempt, placed, port, snapshot_need=need, snapshots_off=off)
    after = msgspec.structs.replace(base, ledger=booked)
    return after, (_job_emit(_grant(after, ev, placed, port, off)),)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def snapshots_off(state: State, placed: tuple[SlotRef, ...], need: int) -> dict[str, str]:
    """The nodes whose snapshot memory cannot hold these ranks' snapshots (`need` bytes each) besides the ranks
    it holds already, and why. Snapshots are an optimisation: the gang is placed by slots, as before."""
    off: dict[str, str] = {}
    if need <= 0:
        return off
    for node in sorted({r.node for r in placed}):
        room = state.nodes[node].snapshot_bytes
        count = sum(1 for r in placed if r.node == node)
        used = ledger_mod.snapshot_used(state.ledger, node)
        if room >= 0 and used + count * need > room:
            off[node] = (f"{node}'s snapshot memory ({_gib(room)}, {_gib(used)} of it held for other ranks) cannot "
                         f"hold {count} more rank(s) of {_gib(need)} each (two snapshots of this job's state and "
                         f"{snapshot.MARGIN}x to spare)")
    return off


def _grant(state: State, ev: AllocationRequested, refs: tuple[SlotRef, ...], port: int,
           off: dict[str, str]) -> AllocationGranted:
    """The answer to `ev`: the slots, and what the request says the attempt restores (its agents start from it)."""
    first = next(r for r in refs if r.rank == 0)
    return AllocationGranted(job_id=ev.job_id, attempt=ev.attempt, assignments=list(refs),
                             master_addr=state.nodes[first.node].address, master_port=port, snapshots_off=off,
                             restore=ev.restore, restore_chosen=ev.restore_chosen)


def transition(state: State, event: Event) -> Transition:
    match event:
        case CoreConfigured(service=service) if service == NAME:
            return msgspec.structs.replace(state, settings=msgspec.convert(event.settings, Settings)), ()
        case NodeRegistered(node=name):
            return _with_node(state, name, kind=event.kind, slots=event.slots, spare=event.spare,
                              address=event.address, lost=False, snapshot_bytes=event.snapshot_bytes, unreached=0), ()
        case NodeCordoned(node=name, reason=reason):
            return _with_node(state, name, cordoned=True, cordon_reason=reason), ()
        case NodeUncordoned(node=name):
            return _with_node(state, name, cordoned=False, cordon_reason=""), ()
        case SelfCheckPassed(node=name):
            return _back(state, name)
        case SelfCheckFailed(node=name, reason=reason):
            return _cordon(state, name, f"self-check failed: {reason}")
        case NodeLost(node=name, reason=reason):
            return _cordon(state, name, f"{LOST_CORDON}{reason}", lost=True)
        case CheckpointScrubbed():
            return _blind(state, event)
        case CheckpointFailed(node=node) if node:
            return _unreached(state, event)
        case AllocationRequested():
            return _allocate(state, event)
        case AllocationReleased(job_id=job_id, attempt=attempt):
            return msgspec.structs.replace(state, ledger=ledger_mod.release(state.ledger, job_id, attempt)), ()
        case JobCompleted(job_id=job_id) | JobFailed(job_id=job_id) | JobCancelled(job_id=job_id):
            return msgspec.structs.replace(state, ledger=ledger_mod.release(state.ledger, job_id)), ()
        case _:
            return state, ()


CONTROL_TYPES = ("AllocationRequested", "AllocationReleased", "JobCompleted", "JobFailed", "JobCancelled",
                 "CheckpointScrubbed", "CheckpointFailed")
FLEET_TYPES = ("NodeRegistered", "NodeCordoned", "NodeUncordoned", "SelfCheckPassed", "SelfCheckFailed", "NodeLost")


def core_service(*, ports: Settings | None = None) -> Service[State]:
    """The resources core wired as a Service, starting from this port range; the shell adds consumers, effects
    and logging."""
    chosen = msgspec.structs.replace(ports or Settings(), denials="named", writers="judged")
    return Service(
        name=NAME,
        initial=State(settings=chosen),
        transition=transition,
        control_subjects=(*subjects.job_types(*CONTROL_TYPES),
                          *(f"fd.ctl.node.*.{t}" for t in FLEET_TYPES)),
        wants_tick=lambda state, now: False,  # nothing here waits on time
        settings=msgspec.structs.asdict(chosen),
        unrecorded=msgspec.structs.asdict(msgspec.structs.replace(chosen, denials="counts", writers="trusted")),
    )
