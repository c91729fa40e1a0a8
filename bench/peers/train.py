"""The one training script of bench/vs_peers.py: the MLP of examples/pytorch_ddp (wider, so a checkpoint is worth
timing) on 2 CPU ranks, one drill fault, and each platform's own way to save and recover, picked by --peer:

    flightdeck  the Flightdeck API (init, register, steps, report), as examples/pytorch_ddp uses it
    torchrun    what a torchrun user writes: rank 0 `torch.save`s model and optimizer every --every steps (to a
                temporary name, then renamed), and every rank loads the newest on start
    dlrover     DLRover's flash checkpoint (DdpCheckpointer): to shared memory every --every steps, to disk every
                4 x --every, `load_checkpoint()` on start (memory first, as its agent keeps it across a restart)
    torchft     torchft's Manager, DistributedDataParallel and Optimizer wrappers on gloo; each rank is its own
                replica group (its own torchrun), so the survivor trains on while the other restarts and takes
                the live state from it at its first quorum: no checkpoint on disk

The fault fires once (a marker file in --workdir): `crash` exits rank 1 with code 3 at --fault-step, `hang` stops
rank 0 there for good (the process stays alive), `lost_node` takes a whole node away at once: the rank running
under the node whose root process id the bench wrote to <--workdir>/lost-node.pid SIGKILLs every process of that
node (the launcher or agent, its helpers, the rank itself), as a host losing power would. Each rank appends JSON
lines to <--workdir>/events.jsonl: "start" (once its state is loaded), "step" (each step done), "fault", and "save"
(how long the loop was held by a save); Flightdeck's ranks also "hold" (the loop held between saves: its host
snapshots in the node's memory).
"""

import argparse
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES, GLOBAL_BATCH = 16, 4, 64


class Log:
    def __init__(self, folder: Path, rank: int) -> None:
        self.file, self.rank = (folder / "events.jsonl").open("a", buffering=1), rank

    def __call__(self, kind: str, **fields: Any) -> None:
        row = {"t": time.time(), "kind": kind, "rank": self.rank, "pid": os.getpid(), **fields}
        self.file.write(json.dumps(row) + "\n")  # a line, flushed: a crash loses nothing before it


def teacher() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def student(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    hidden = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), *hidden, nn.Linear(width, CLASSES))


def batch(index: int, rank: int, world: int, label: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch `index`: a pure function of `index`, so a resumed run reads the same."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    with torch.no_grad():
        y = label(x).argmax(dim=1)
    rows = torch.tensor_split(torch.arange(GLOBAL_BATCH), world)[rank]
    return x[rows], y[rows]


def train_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


class Fault:
    """The drill: fires once across restarts (its marker file), on its rank, at its step."""

    def __init__(self, args: argparse.Namespace, log: Log) -> None:
        self.kind, self.step, self.log = args.fault, args.fault_step, log
        self.marker = args.workdir / f"fired-{args.fault}"
        self.rank = 1 if args.fault == "crash" else 0
        self.node_file = args.workdir / "lost-node.pid"

    def mine(self, rank: int) -> bool:
        if self.kind == "lost_node":  # whichever rank the launcher placed on the lost node
            return int(self.node_file.read_text()) in ancestors(os.getpid())
        return rank == self.rank

    def maybe(self, rank: int, step: int) -> None:
        if self.kind == "none" or step != self.step or self.marker.exists() or not self.mine(rank):
            return
        self.marker.touch()
        self.log("fault", step=step, fault=self.kind)
        if self.kind == "crash":
            os._exit(3)
        if self.kind == "lost_node":
            kill_tree(int(self.node_file.read_text()))
        while True:  # hung: alive, silent, never stepping again
            time.sleep(3600)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1:
        out.add(pid)
        pid = parent(pid)
    return out


def kill_tree(root: int) -> None:
    """SIGKILL `root` and every process below it, this one last: the whole node at once, none left to notice."""
    tree, children = {root}, dict[int, list[int]]()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile
                children.setdefault(parent(int(proc.name)), []).append(int(proc.name))
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            tree.add(child)
            todo.append(child)
    for pid in sorted(tree - {os.getpid()}):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def run_flightdeck(args: argparse.Namespace) -> None:
    import flightdeck

    run = flightdeck.init()
    log, label = Log(args.workdir, run.rank), teacher()
    fault = Fault(args, log)
    model = student(args.width, args.layers)
    if run.world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run.register(model, opt)
    start = run.restore()
    log("start", step=start)
    every = run.spec.train.checkpoint_every
    steps, began = iter(run.steps(args.steps)), time.perf_counter()
    for step in steps:  # a checkpoint's snapshot is taken inside the iterator, before the step it is due at
        held = time.perf_counter() - began
        if step % every == 0 and step != start:
            log("save", step=int(step), stall_s=held)
        elif step != start:  # the loop held by the boundary's work alone: a host snapshot when one is due
            log("hold", step=int(step), stall_s=held)
        fault.maybe(run.rank, step)
        x, y = batch(step.batch, run.rank, run.world_size, label)
        run.report(step, train_step(model, opt, x, y))
        time.sleep(args.pace_s)
        log("step", step=int(step))
        began = time.perf_counter()


Saver = Callable[[int, int, dict[str, Any]], dict[str, str]]  # (rank, step, state) -> fields for the "save" line


def ddp_loop(args: argparse.Namespace, load: Callable[[], dict[str, Any] | None], save: Saver) -> None:
    """The loop torchrun and DLRover run: plain DDP on gloo, the state from `load` (None: from scratch), `save`
    every --every steps (its hold of the loop is the stall)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log, label = Log(args.workdir, rank), teacher()
    fault = Fault(args, log)
    model = nn.parallel.DistributedDataParallel(student(args.width, args.layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    if state := load():
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    log("start", step=start)
    for step in range(start, args.steps):
        if step % args.every == 0 and step != start:
            began = time.perf_counter()
            fields = save(rank, step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
            log("save", step=step, stall_s=time.perf_counter() - began, **fields)
        fault.maybe(rank, step)
        train_step(model, opt, *batch(step, rank, world, label))
        time.sleep(args.pace_s)
        log("step", step=step)
    dist.destroy_process_group()


def run_torchrun(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    folder = args.workdir / "torchrun-ckpt"
    folder.mkdir(exist_ok=True)

    def load() -> dict[str, Any] | None:
        done = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.removeprefix("step-")))
        return torch.load(done[-1], weights_only=True) if done else None

    def save(rank: int, step: int, state: dict[str, Any]) -> dict[str, str]:
        if rank == 0:
            tmp = folder / f".step-{step}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, folder / f"step-{step}.pt")
        return {}

    ddp_loop(args, load, save)


def run_dlrover(args: argparse.Namespace) -> None:
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    dist.init_process_group("gloo")
    checkpointer = DdpCheckpointer(str(args.workdir / "dlrover-ckpt"))  # after init: it asks dist for the rank

    def save(rank: int, step: int, state: dict[str, Any]) -> dict[str, str]:
        to = StorageType.DISK if step % (4 * args.every) == 0 else StorageType.MEMORY
        checkpointer.save_checkpoint(step, state, storage_type=to)
        return {"storage": str(to)}

    ddp_loop(args, lambda: checkpointer.load_checkpoint() or None, save)


def run_torchft(args: argparse.Namespace) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    log, label = Log(args.workdir, group), teacher()
    fault = Fault(args, log)
    model = student(args.width, args.layers)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"peers_{group}", timeout=timedelta(seconds=10))
    ddp, opt = DistributedDataParallel(manager, model), Optimizer(manager, inner)
    log("start", step=manager.current_step())
    while (step := manager.current_step()) < args.steps:
        fault.maybe(group, step)
        x, y = batch(step, group, groups, label)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)  # starts the quorum; a restarted replica is sent the live state here
        loss.backward()
        opt.step()  # steps the inner optimizer only if every participant's step went through
        time.sleep(args.pace_s)
        if manager.current_step() > step:  # committed: a step a peer failed in is not counted, and redone
            log("step", step=step, participants=manager.num_participants())
    manager.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=("flightdeck", "torchrun", "dlrover", "torchft"), required=True)
    ap.add_argument("--workdir", type=Path, required=True, help="a folder for the events and the fault's marker")
    ap.add_argument("--fault", choices=("none", "crash", "hang", "lost_node"), default="crash")
    ap.add_argument("--fault-step", type=int, default=100)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=10, help="steps between saves (flightdeck: the spec's)")
    ap.add_argument("--pace-s", type=float, default=0.05, help="sleep after each step, as a slower model would")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    {"flightdeck": run_flightdeck, "torchrun": run_torchrun, "dlrover": run_dlrover, "torchft": run_torchft}[
        args.peer](args)


if __name__ == "__main__":
    main()
