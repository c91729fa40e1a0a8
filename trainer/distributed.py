"""One rank per process: the torch.distributed groups, and the small collective that makes every rank act on
the same command at the same step."""

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    # Separate gloo groups so the checkpoint writer thread and the command agreement never interleave
    # their collectives with DDP's all-reduces on the default group (and stay on CPU under NCCL).
    ctl_group: dist.ProcessGroup | None
    ckpt_group: dist.ProcessGroup | None

    @property
    def distributed(self) -> bool:
        return self.ctl_group is not None

    def agree(self, flags: list[int], payload: bytes) -> tuple[list[int], bytes]:
        """The largest of every rank's value of each flag (of 0/1 flags: any rank's 1 wins) and rank 0's payload, on
        every rank."""
        if self.ctl_group is None:
            return flags, payload
        mine = payload if self.rank == 0 else b""
        vec = torch.tensor([*flags, len(mine)], dtype=torch.int64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.ctl_group)
        *agreed, size = (int(v) for v in vec.tolist())
        if size == 0:
            return agreed, b""
        if self.rank == 0:
            # a tensor owning its bytes: one over a Python buffer needs the GIL wherever gloo frees it
            buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).clone()
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.ctl_group)
        return agreed, bytes(buf.numpy().tobytes())

    def barrier(self) -> None:
        if self.ctl_group is not None:
            dist.barrier(group=self.ctl_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A rank that had closed cleanly once died after its exit log with SIGABRT ("terminate called without an
        # active exception"), the mark of a C++ thread meeting a finalizing interpreter. Drop our handles too, so
        # the gloo groups are torn down, their threads joined, while the interpreter is whole.
        groups = (self.ctl_group, self.ckpt_group)
        self.ctl_group = self.ckpt_group = None
        if any(g is not None for g in groups):
            del groups
            gc.collect()  # a full collection: in a process with a large heap it costs a good part of a second


class RendezvousShared(RuntimeError):
    """Ranks of another job (or attempt) joined this rank's rendezvous: its MASTER_PORT is the only key."""


def init(rank: int, world_size: int, local_rank: int, device: str, identity: str = "") -> Dist:
    """Join the job's group from the torchrun variables (MASTER_ADDR/PORT); a single rank needs none. With
    `identity` (job and attempt), every rank of the group must have the same: RendezvousShared if not."""
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size == 1:
        return Dist(rank, 1, dev, None, None)
    if not dist.is_initialized():  # a script may have joined its own group already
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=dev if device == "cuda" else None)
    ctl = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    ckpt = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    if identity:
        # a rank of another job on this host and port (another platform's, a torchrun of one's own) would otherwise
        # train, save and load with this one: once, two of them read each other's checkpoint files
        peers: list[object] = [None] * world_size
        dist.all_gather_object(peers, identity, group=ctl)
        strangers = sorted({str(p) for p in peers if p != identity})
        if strangers:
            dist.destroy_process_group()  # not left up for the exit to tear down (gloo may abort the process)
            raise RendezvousShared(f"rank {rank} of {identity} met ranks of {', '.join(strangers)} at "
                                   f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}: "
                                   "another job shares this rendezvous; nothing was trained")
    return Dist(rank, world_size, dev, ctl, ckpt)
