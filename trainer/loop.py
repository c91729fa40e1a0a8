"""The flat training loop of one rank, and what it does at step boundaries.

Steps are numbered from 0. `self.step` is the number of steps done, i.e. the index of the next step;
checkpoint step-N holds the state before step N runs. Without skips, step i reads global batch i.
StepCompleted(step=i) reports step i; the heartbeat then reports i.

At a boundary, every `sync_every` steps (every step when paused or alone), rank 0's commands and every
rank's SIGTERM flag are agreed with one small collective, so all ranks act at the same step: DCP saves
and loads are collective.
"""

import math
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Protocol

import msgspec
import structlog
import torch
import torch.nn.functional as F

from events import codec
from events.base import Event
from events.checkpoint import ShardInfo
from events.commands import (
    CheckpointRequested,
    PauseRequested,
    ResumeRequested,
    RollbackRequested,
    StopRequested,
)
from events.spec import FaultKind
from events.training import FaultInjected, RankStarted, RolledBack
from trainer import checkpointing, faults, model
from trainer.config import RunConfig
from trainer.data import TokenStream, load_tokens
from trainer.distributed import Dist
from trainer.reports import Emitter, StepReporter

log = structlog.get_logger(__name__)
PAUSE_POLL_S = 0.2
ROLLBACK_WAIT_S = 30.0  # for the node agent's prefetch of a committed checkpoint to land
GRAD_CLIP = 1.0


class CommandSource(Protocol):
    """What the loop needs from a command inbox; trainer.commands.CommandInbox has this shape."""

    def poll(self) -> list[Event]:
        """Commands received since the last poll, in order."""


class Stop(Exception):
    """Leave the loop with this exit code after the boundary's work is done."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up, then cosine decay to a tenth: a pure function of the step, so nothing to checkpoint."""
    warmup = max(1, min(100, total // 10))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def admitted(raws: list[bytes]) -> list[Event]:
    """The agreed commands that pass `codec.admit`; a refused one is logged and not acted on. Every rank
    decodes the same agreed bytes, so every rank refuses the same commands and the collectives stay in step."""
    out: list[Event] = []
    for raw in raws:
        try:
            out.append(codec.admit(raw))  # the bounds too: a rollback's checkpoint id becomes a cache path
        except codec.UndecodableEvent as exc:
            log.error("refusing a command", error=str(exc))
    return out


class Loop:
    def __init__(self, cfg: RunConfig, dist: Dist, emitter: Emitter, inbox_poll: CommandSource) -> None:
        spec = cfg.spec
        self.cfg, self.dist, self.emitter, self.inbox = cfg, dist, emitter, inbox_poll
        self.total = spec.train.steps
        torch.manual_seed(spec.train.seed * 1000 + dist.rank)
        self.model = model.build(spec.model, spec.train.seed, dist.device)
        # Fused AdamW takes `found_inf` on the device: a non-finite step is skipped without a host sync.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec.train.lr, betas=(0.9, 0.95),
                                     weight_decay=0.01, fused=True)
        self.stream = TokenStream(load_tokens(spec.train.data, spec.model.vocab_size), seq_len=spec.model.seq_len,
                                  batch_size=spec.train.batch_size, seed=spec.train.seed, rank=dist.rank,
                                  world_size=dist.world_size, vocab_size=spec.model.vocab_size)
        self.faults = faults.Faults(spec.faults, dist.rank, cfg.attempt)
        self.stream.poisoned = self.faults.poison
        self.live = checkpointing.train_state(self.model, self.opt)
        self.ckpt = checkpointing.Checkpointer(job_id=cfg.job_id, staging=cfg.staging, dist=dist,
                                               emit=emitter.emit, envelope=emitter.envelope)
        self.step = 0
        self.saved_at: int | None = None  # the boundary whose state is already checkpointed
        if cfg.restore is not None:
            shards = checkpointing.read_manifest(cfg.manifest) if cfg.manifest else None
            self.step = checkpointing.load(cfg.restore, self.live, self.stream, dist, shards)
            self.saved_at = self.step
        self.ckpt.prepare(self.live)
        self.ddp = dist.wrap(self.model)
        self.reporter = StepReporter(emitter, dist.device, self.stream.local_batch * spec.model.seq_len)
        self.global_tokens = spec.train.batch_size * spec.model.seq_len
        self.paused = False
        self.sigterm = False
        self.cmd_decoder = msgspec.msgpack.Decoder(list[bytes])

    # -- the loop ------------------------------------------------------------------------------------

    def install_signals(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            self.sigterm = True

        signal.signal(signal.SIGTERM, on_term)

    def run(self) -> int:
        self.emitter.emit(RankStarted(world_size=self.dist.world_size, from_step=self.step,
                                      device=str(self.dist.device), **self.emitter.envelope))
        self.emitter.set_step(self.step - 1)
        try:
            while True:
                if self.dist.world_size == 1 or self.paused or self.step % self.cfg.sync_every == 0:
                    self.boundary()
                if self.paused:
                    self.emitter.flush()
                    time.sleep(PAUSE_POLL_S)
                    continue
                if self.step > 0 and self.step % self.cfg.spec.train.checkpoint_every == 0:
                    self.checkpoint()
                if self.step >= self.total:
                    break
                self.train_step()
        except Stop as stop:
            self.reporter.flush()
            self.ckpt.wait()
            return stop.code
        self.reporter.flush()
        self.ckpt.wait()
        log.info("training finished", steps=self.step)
        return 0

    def train_step(self) -> None:
        step = self.step
        started = time.perf_counter()
        index = self.stream.next_index()
        nan = False
        for fault in self.faults.due(step, index):
            nan = nan or self.inject(fault.kind, step)
        delay = self.faults.slow_seconds(step)
        if delay:
            time.sleep(delay)
        x, y = (t.to(self.dist.device, non_blocking=True) for t in self.stream.batch(index))
        lr = lr_at(step, self.total, self.cfg.spec.train.lr)
        for group in self.opt.param_groups:
            group["lr"] = lr
        with torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.dist.device.type == "cuda"):
            logits = self.ddp(x)
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        if nan:
            loss_sum = loss_sum * float("nan")
        # DDP averages gradients over ranks; scaling by world/global tokens makes the result the
        # gradient of the global batch's mean loss at any world size, even with uneven slices.
        self.opt.zero_grad(set_to_none=True)
        (loss_sum * (self.dist.world_size / self.global_tokens)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.opt.found_inf = (~torch.isfinite(grad_norm)).float()  # type: ignore[attr-defined]
        self.ckpt.before_update()
        self.opt.step()
        self.reporter.record(step, loss_sum.detach() / y.numel(), grad_norm.detach(), lr, started)
        self.step += 1

    def inject(self, kind: FaultKind, step: int) -> bool:
        """Announce a drill fault, then act on it; True when this step's loss must be NaN."""
        self.emitter.emit(FaultInjected(kind=kind, step=step, **self.emitter.envelope))
        log.warning("injecting drill fault", kind=kind, step=step)
        if kind == "crash":
            self.reporter.flush()
            self.emitter.crash(faults.CRASH_EXIT_CODE)
        if kind == "hang":
            self.reporter.flush()
            self.emitter.flush()
            faults.hang(lambda: self.sigterm)
            raise Stop(faults.HANG_EXIT_CODE)
        return kind == "nonfinite"

    # -- step boundaries -----------------------------------------------------------------------------

    def boundary(self) -> None:
        payload = b""
        if self.dist.rank == 0:
            polled = self.inbox.poll()
            if polled:
                payload = msgspec.msgpack.encode([codec.encode(c) for c in polled])
        (sigterm,), payload = self.dist.agree([int(self.sigterm)], payload)
        commands = admitted(self.cmd_decoder.decode(payload)) if payload else []
        for command in commands:
            self.obey(command)
        if sigterm:
            log.warning("SIGTERM: checkpointing before exit (preemption)", step=self.step)
            self.checkpoint(wait=True)
            raise Stop(0)

    def obey(self, command: Event) -> None:
        log.info("command", type=type(command).__name__, step=self.step)
        match command:
            case CheckpointRequested():
                self.checkpoint()
            case StopRequested(checkpoint=save):
                if save:
                    self.checkpoint(wait=True)
                raise Stop(0)
            case PauseRequested():
                self.paused = True
            case ResumeRequested():
                self.paused = False
            case RollbackRequested():
                self.rollback(command)
            case _:
                log.warning("ignoring a command this trainer does not know", type=type(command).__name__)

    def checkpoint(self, *, wait: bool = False) -> None:
        if self.saved_at != self.step:
            self.ckpt.save(self.step, self.live, self.stream)
            self.saved_at = self.step
        if wait:
            self.ckpt.wait()

    def rollback(self, cmd: RollbackRequested) -> None:
        self.reporter.flush()
        self.ckpt.wait()
        path = self.find_checkpoint(cmd.checkpoint_id, cmd.to_step)
        manifest = checkpointing.manifest_in(path)
        shards: list[ShardInfo] | None = checkpointing.read_manifest(manifest) if manifest else None
        self.step = checkpointing.load(path, self.live, self.stream, self.dist, shards)
        self.stream.skip(cmd.skip_from, cmd.skip_to)
        self.saved_at = self.step
        timeline = self.ckpt.rolled_back()
        self.emitter.set_step(self.step - 1)
        self.emitter.emit(RolledBack(checkpoint_id=cmd.checkpoint_id, to_step=self.step, skip_from=cmd.skip_from,
                                     skip_to=cmd.skip_to, timeline=timeline, **self.emitter.envelope))
        log.warning("rolled back", checkpoint=str(path), to_step=self.step, skip=(cmd.skip_from, cmd.skip_to))

    def find_checkpoint(self, checkpoint_id: str, step: int) -> Path:
        """Where a rollback's checkpoint is: the node's cache of committed checkpoints (--checkpoints), which a
        prefetch may still be filling, else what this node staged (same id, or step-<N> from this run)."""
        cached = self.cfg.checkpoints / self.cfg.job_id / checkpoint_id if self.cfg.checkpoints else None
        staged = [self.cfg.staging / self.cfg.job_id / checkpoint_id, *self.ckpt.staged_dirs(step)]
        deadline = time.monotonic() + (ROLLBACK_WAIT_S if cached else 0.0)
        while True:
            if cached is not None and (cached / ".metadata").exists():
                return cached
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        for path in staged:
            if (path / ".metadata").exists():
                log.warning("rolling back from local staging, not a committed checkpoint", path=str(path))
                return path
        raise checkpointing.CorruptCheckpoint(
            f"checkpoint {checkpoint_id} (step {step}) is in none of {[str(p) for p in [cached, *staged] if p]}")
