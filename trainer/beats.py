"""A rank's heartbeat to its node agent: one datagram on the node-local socket the agent named in
$FLIGHTDECK_BEATS, instead of one JetStream message per rank per interval (the agent publishes one batch
per node, services/resources/beats.py).

The address is a filesystem path, or `@name` for a Linux abstract socket (no file, no path-length limit,
gone with the agent). Sending never blocks: a full socket buffer drops the beat (the next one supersedes
it). A socket nobody listens on means the agent is gone, which the caller hears as False and answers by
heartbeating through the broker again.
"""

import errno
import os
import socket

import msgspec

from events.heartbeats import LocalBeat

BEATS_ENV = "FLIGHTDECK_BEATS"  # set by the node agent for the ranks it starts
STEP_REPORTS_ENV = "FLIGHTDECK_STEP_REPORTS"  # "all" (default) or "rank0", set by the node agent
STEP_REPORTS = ("all", "rank0")
_encoder = msgspec.msgpack.Encoder()


def sockaddr(address: str) -> str:
    """`@name` is the abstract socket `name` (Linux); anything else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


def steps_to_bus(rank: int, channel: "BeatChannel | None") -> bool:
    """Whether this rank publishes a StepCompleted per step. With "rank0" (a fleet setting: one message per
    rank per step is more than a broker stores at thousands of ranks) only rank 0 does, and only while an
    agent carries the others' steps and step times in its batches."""
    mode = os.environ.get(STEP_REPORTS_ENV, "") or "all"
    if mode not in STEP_REPORTS:
        raise ValueError(f"${STEP_REPORTS_ENV}={mode!r}: choose one of {', '.join(STEP_REPORTS)}")
    return mode == "all" or rank == 0 or channel is None


class BeatChannel:
    def __init__(self, address: str) -> None:
        if not address or address == "@":
            raise ValueError(f"${BEATS_ENV} is empty: a path or @name of the node agent's heartbeat socket")
        self.address = address
        self._to = sockaddr(address)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.num_sent = 0
        self.num_dropped = 0

    @classmethod
    def from_env(cls) -> "BeatChannel | None":
        address = os.environ.get(BEATS_ENV, "")
        return cls(address) if address else None

    def send(self, beat: LocalBeat) -> bool:
        """Hand one beat over; False when no agent listens there any more."""
        try:
            self._sock.sendto(_encoder.encode(beat), self._to)
        except BlockingIOError:  # the agent is behind: this beat is superseded by the next
            self.num_dropped += 1
            return True
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTCONN):
                return False
            self.num_dropped += 1
            return True
        self.num_sent += 1
        return True

    def close(self) -> None:
        self._sock.close()
