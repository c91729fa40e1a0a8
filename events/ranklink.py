"""The link between a rank and its node agent: one SOCK_SEQPACKET connection per rank (messages keep their
bounds and their order; the kernel says which process is at the other end). It is the rank's only link to the
platform: no broker client and no broker credential ever enter a user's process.

Up, the rank sends `Hello` once, then its events in `Events` batches; the agent takes custody of each batch
(`Taken`) and publishes the events on the rank's telemetry subjects with their own ids as msg ids, in order.
Down, the agent sends what the rank needs: the job's commands in history order (`Command`), the parallel plan
(`Plan`), and where a rollback's checkpoint is on this node (`RollbackReady`).

Both sides import this module; why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import socket
from typing import Annotated

import msgspec
from msgspec import Meta

from flightdeck.events.plan import ParallelPlan

LINK_ENV = "FLIGHTDECK_AGENT"  # the agent's link socket (@name: abstract), set for the ranks it starts
MAX_MESSAGE = 1 << 20  # the broker's own payload limit: an event larger than this could never be stored
SOCKET_BUFFER = 4 << 20  # room for a burst of steps while the other side is busy
BATCH_BYTES = 256 << 10  # an Events message carries at most this much (and at least one event)

_Token = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}\Z")]
_Count = Annotated[int, Meta(ge=0)]


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello"):
    """Who the rank says it is; the agent checks the claim against the pid it started for that rank."""

    job_id: _Token
    attempt: _Count
    rank: Annotated[int, Meta(ge=0, lt=65_536)]


class Events(msgspec.Struct, frozen=True, kw_only=True, tag="events"):
    """Encoded events (events.codec), in emit order; `upto` counts the rank's events sent so far, this batch's
    last included."""

    upto: _Count
    events: list[bytes]


Up = Hello | Events


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag="welcome"):
    """The agent knows this process as the rank it claims to be."""


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    """The agent does not run this process as that rank (or cannot take it): the link closes after this."""

    reason: str


class Taken(msgspec.Struct, frozen=True, kw_only=True, tag="taken"):
    """The agent holds the rank's events up to `upto` (and will publish them, outliving the rank); `refused` of
    them were not the rank's to send (another job's, malformed) and are dropped with a log line on the agent."""

    upto: _Count
    refused: _Count = 0


class Command(msgspec.Struct, frozen=True, kw_only=True, tag="command"):
    """A command of the job's history for this attempt, as stored (flightdeck.events.codec bytes)."""

    event: bytes


class Plan(msgspec.Struct, frozen=True, kw_only=True, tag="plan"):
    """The newest parallel plan the resharder recorded for the job."""

    plan: ParallelPlan


class RollbackReady(msgspec.Struct, frozen=True, kw_only=True, tag="rollback_ready"):
    """A rollback's checkpoint is in this node's cache at `path` (verified as downloaded), or it could not be
    fetched (`problem` says why, `path` empty): the rank refuses the rollback at once."""

    checkpoint_id: str
    path: str = ""
    problem: str = ""


Down = Welcome | Refused | Taken | Command | Plan | RollbackReady

ENCODER = msgspec.msgpack.Encoder()
UP_DECODER = msgspec.msgpack.Decoder(Up)
DOWN_DECODER = msgspec.msgpack.Decoder(Down)


def sockaddr(address: str) -> str:
    """`@name` is the abstract socket `name` (Linux); anything else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


def link_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return sock
