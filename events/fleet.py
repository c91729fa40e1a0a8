"""The fleet: nodes, their slots, self-checks and cordons."""

from typing import Literal

from events.base import NodeEvent


class NodeRegistered(NodeEvent, frozen=True, kw_only=True):
    kind: Literal["cpu", "gpu"]
    slots: int
    devices: list[str] = []  # device names, e.g. "NVIDIA H100 80GB HBM3"
    memory_gb: float = 0.0
    spare: bool = False  # held back to replace failed slots
    address: str = "127.0.0.1"  # where ranks reach this node (MASTER_ADDR when rank 0 runs here)


class NodeHeartbeat(NodeEvent, frozen=True, kw_only=True):
    """An agent's liveness; only emitted when the fleet view changes, never at a fixed rate."""

    free_slots: int


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
