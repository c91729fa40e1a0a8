"""The node-local protocol between a node agent and the ranks it starts: the variables it sets for them, the
heartbeat socket, and the warm-standby hand-off (the rank's link itself: events/ranklink.py). Both sides import
it; nothing here reaches the broker.

Why it works this way: docs/internals.md, "1. The event log".
"""

import errno
import os
import socket

import msgspec

from flightdeck.events.heartbeats import LocalBeat
from flightdeck.events.ranklink import LINK_ENV
from flightdeck.events.snapshot import SNAPSHOTS_ENV, SNAPSHOTS_OFF_ENV

BEATS_ENV = "FLIGHTDECK_BEATS"  # the agent's heartbeat socket, set for the ranks it starts
STEP_REPORTS_ENV = "FLIGHTDECK_STEP_REPORTS"  # "all" (default) or "rank0": who publishes StepCompleted
STEP_REPORTS = ("all", "rank0")

# What the agent tells every rank it starts, built-in trainer or a user's entrypoint alike; the trainer API
# (trainer/session.py) reads them in `init()`. Without JOB_ENV a script runs in no-platform mode.
JOB_ENV = "FLIGHTDECK_JOB_ID"
ATTEMPT_ENV = "FLIGHTDECK_ATTEMPT"
NODE_ENV = "FLIGHTDECK_NODE"
SPEC_ENV = "FLIGHTDECK_SPEC"  # the job spec as TOML, written by the agent
STAGING_ENV = "FLIGHTDECK_STAGING"  # where ranks stage checkpoints: <dir>/<job>/step-<N>/
RESTORE_ENV = "FLIGHTDECK_RESTORE"  # a verified checkpoint directory to restore before the first step
MANIFEST_ENV = "FLIGHTDECK_MANIFEST"  # its manifest (sizes and sha256s), checked again by the rank
CACHE_ENV = "FLIGHTDECK_CACHE"  # the node's cache of committed checkpoints: <dir>/<job>/<checkpoint_id>/
# A rank whose restore checkpoint fails its own check (the agent's passed a moment before: a disk rotting under
# it) exits with this before loading anything; its agent records CheckpointRejected, so the restart is free.
RESTORE_REFUSED_EXIT = 65  # EX_DATAERR
# Exit 0 means "every step ran", and nothing else: a rank that stops before its last step (told to, a SIGTERM from
# outside the platform such as an eviction, or a script that left run.steps() early) exits with this, so its
# exit reads as a fault to restart, never as the job's completion.
STOPPED_EXIT = 75  # EX_TEMPFAIL: try again
# Batch windows a restore skips on top of its checkpoint's own ("40:45,50:60"): rollbacks decided back to that
# checkpoint after it was written (events/lineage.restore_skips).
RESTORE_SKIPS_ENV = "FLIGHTDECK_RESTORE_SKIPS"
# "model": the restore loads the checkpoint's weights only and the run starts at step 0 (a job initialised from
# another job's checkpoint, spec init_from.what = "model"); unset: everything, from its step.
RESTORE_ONLY_ENV = "FLIGHTDECK_RESTORE_ONLY"
DEVICE_ENV = "FLIGHTDECK_DEVICE"  # "cpu", "cuda" or "auto"
SYNC_EVERY_ENV = "FLIGHTDECK_SYNC_EVERY"  # steps between the collectives that agree on commands
EVENTS_LOG_ENV = "FLIGHTDECK_EVENTS_LOG"  # every event a rank emits, also as JSON lines here
PLAN_ENV = "FLIGHTDECK_PLAN"  # a ParallelPlan as JSON: the agent's when it knows this world's at the start
FIRED_ENV = "FLIGHTDECK_FIRED_FAULTS"  # indices of the spec's unpinned drill faults an earlier attempt fired: "0,3"
RUN_ENV = (JOB_ENV, ATTEMPT_ENV, NODE_ENV, LINK_ENV, SPEC_ENV, STAGING_ENV, RESTORE_ENV, RESTORE_ONLY_ENV,
           MANIFEST_ENV, CACHE_ENV, DEVICE_ENV, SYNC_EVERY_ENV, EVENTS_LOG_ENV, PLAN_ENV, FIRED_ENV, BEATS_ENV,
           STEP_REPORTS_ENV, SNAPSHOTS_ENV, SNAPSHOTS_OFF_ENV)

READY = b"R"
MAX_MESSAGE = 1 << 20  # an assignment is the rank's command line and environment: a few KB
# What a rank's run reads from the environment only after the assignment (torch.distributed, flightdeck.trainer.config).
LATE_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"})
# What acts before an assignment reaches a standby: the interpreter's start (PYTHON*, the locale), the dynamic
# loader and allocator, and what torch, its thread pools and CUDA read when imported. A job's variable among these
# starts its ranks cold (exec); any other (HF_HUB_OFFLINE, WANDB_*, a script's own) is set before the script runs,
# where it reads it, so a job's `env` keeps its warm starts (a Llama job's crash restart took 17.8 s cold, 3-4 warm).
EARLY_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
                      "TORCH", "PYTORCH_", "CUDA_", "CUBLAS_", "CUDNN_", "NVIDIA_", "TRITON_")
EARLY_ENV = frozenset({"LANG", "LANGUAGE", "TZ", "TMPDIR"})


def acts_early(name: str) -> bool:
    """Whether variable `name` may have acted before a standby's assignment (so a change of it needs a cold start)."""
    return name not in LATE_ENV and (name in EARLY_ENV or name.startswith(EARLY_ENV_PREFIXES))


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    """The rank a standby becomes: the command line and environment a cold start would exec, and its cwd."""

    argv: list[str]  # argv[0] is the interpreter, as for execve
    env: dict[str, str]
    cwd: str


ASSIGNMENT_ENCODER = msgspec.msgpack.Encoder()
ASSIGNMENT_DECODER = msgspec.msgpack.Decoder(Assignment)


# The fork server (trainer/forkserver.py) and its agent (services/agent/forkserver.py), over a SOCK_SEQPACKET pair.
class ForkRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Fork a child. `assignment` None: a standby (descriptors: its log, its end of a standby socket pair), which
    then waits for an Assignment as trainer/standby.py does; else the child becomes `assignment` at once
    (descriptor: its stdout and stderr)."""

    assignment: Assignment | None = None


class ServerReady(msgspec.Struct, frozen=True, kw_only=True, tag="ready"):
    """Sent twice: once torch is in (`complete` false: a self-check can be forked), then once all a rank imports
    is in (standbys can be forked)."""

    warmup_s: float  # the imports so far took this long
    complete: bool


class Forked(msgspec.Struct, frozen=True, kw_only=True, tag="forked"):
    """The answer to one ForkRequest, in the order they came."""

    pid: int


class ForkRefused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    """The answer to a ForkRequest the server could not read or carry out."""

    reason: str


class ChildExited(msgspec.Struct, frozen=True, kw_only=True, tag="exited"):
    """A child ended; `code` as asyncio's returncode: the exit code, or -N for signal N. Only the fork server, its
    parent, can read it, so the agent learns it here."""

    pid: int
    code: int


ForkServerMessage = ServerReady | Forked | ForkRefused | ChildExited
FORK_REQUEST_DECODER = msgspec.msgpack.Decoder(ForkRequest)
FORK_SERVER_DECODER = msgspec.msgpack.Decoder(ForkServerMessage)
_beat_encoder = msgspec.msgpack.Encoder()


def sockaddr(address: str) -> str:
    """`@name` is the abstract socket `name` (Linux); anything else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


class BeatChannel:
    """A rank's end of the heartbeat socket."""

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
            self._sock.sendto(_beat_encoder.encode(beat), self._to)
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
