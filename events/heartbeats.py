"""Heartbeats batched per node: what one node agent publishes each interval for every rank of a job it runs.

Why it works this way: docs/internals.md, "1. The event log".
"""

from typing import Annotated

import msgspec
from msgspec import Meta

from flightdeck.events.base import RankEvent


class RankBeat(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's newest heartbeat as its agent saw it."""

    rank: int
    step: int  # last completed step, as a Heartbeat carries it
    occurred_at: float  # when the rank beat (its own clock), not when the batch left
    step_time_s: float = 0.0  # that step's duration; 0 when not known (no step completed yet)


class RankHeartbeats(RankEvent, frozen=True, kw_only=True):
    """The heartbeats of a node's ranks of one job and attempt since the agent's previous batch; `rank` is the
    node's subject rank (the lowest it has relayed), `node` the agent's node. Readers use the entries' ranks."""

    interval_s: float
    beats: list[RankBeat]


_Token = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}\Z")]
_Count = Annotated[int, Meta(ge=0)]
_Time = Annotated[float, Meta(ge=0.0, le=1e11)]


class LocalBeat(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="LocalBeat.v1"):
    """One heartbeat of one rank, rank to its agent (msgpack over the node's socket; version in the tag)."""

    job_id: _Token
    attempt: _Count
    rank: Annotated[int, Meta(ge=0, lt=65_536)]
    step: Annotated[int, Meta(ge=-1)]
    occurred_at: _Time
    interval_s: Annotated[float, Meta(gt=0.0, le=86_400.0)]
    step_time_s: Annotated[float, Meta(ge=0.0, le=1e9)] = 0.0
