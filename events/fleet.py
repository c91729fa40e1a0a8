"""The fleet: nodes, their slots, self-checks and cordons."""

from typing import Literal

from flightdeck.events.base import NodeEvent


class NodeRegistered(NodeEvent, frozen=True, kw_only=True):
    kind: Literal["cpu", "gpu"]
    slots: int
    devices: list[str] = []  # device names, e.g. "NVIDIA H100 80GB HBM3"
    memory_gb: float = 0.0
    spare: bool = False  # held back to replace failed slots
    address: str = "127.0.0.1"  # where ranks reach this node (MASTER_ADDR when rank 0 runs here)
    # What its ranks' host snapshots may take of its memory (events/snapshot.py): 0 none, -1 not reported.
    snapshot_bytes: int = -1


class NodeHeartbeat(NodeEvent, frozen=True, kw_only=True):
    """What an agent holds ready: its free slots and warm standby ranks; emitted when they change (a standby
    warmed, taken or lost), never at a fixed rate."""

    SCHEMA = 3  # 2 added `standbys`, 3 `snapshot_held`

    free_slots: int
    standbys: int = 0  # warm standby ranks ready to become a rank now (services/agent/standbys.py)
    # Bytes its ranks' snapshots hold in its memory (events/snapshot.py; shared memory is RAM), to within 1/16th;
    # -1: not said (an older agent, or snapshots off)
    snapshot_held: int = -1


class AgentAlive(NodeEvent, frozen=True, kw_only=True):
    """A node agent's sign of life while it runs no ranks (while it does, its heartbeat batches are): every
    `interval_s` on telemetry (fd.tel._fleet.<node>.AgentAlive, never the permanent control stream). The health
    monitor declares the node lost when they stop (issue 51: an agent that died idle was found only when a job
    granted to it waited out the start grace)."""

    interval_s: float


class SelfCheckPassed(NodeEvent, frozen=True, kw_only=True):
    seconds: float
    detail: str = ""


class SelfCheckFailed(NodeEvent, frozen=True, kw_only=True):
    reason: str


class NodeCordoned(NodeEvent, frozen=True, kw_only=True):
    reason: str


class NodeUncordoned(NodeEvent, frozen=True, kw_only=True):
    reason: str = ""


class NodeLost(NodeEvent, frozen=True, kw_only=True):
    reason: str
