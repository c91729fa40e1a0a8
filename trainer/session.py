"""The trainer API's one object, `Run`: a rank's link to Flightdeck, what its script registered, and the step
loop's boundaries, where commands are obeyed, checkpoints saved, and drill faults fired.

Steps are numbered from 0. `run.step` is the number of steps done, i.e. the index of the next step;
checkpoint step-N holds the state before step N runs. Without skips, step i reads global batch i.

At a boundary, every `sync_every` steps (every step when paused or alone), rank 0's commands and every
rank's SIGTERM flag are agreed with one small collective, so all ranks act at the same step: DCP saves
and loads are collective.
"""

import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import NoReturn, TypeVar

import msgspec
import structlog
import torch
from torch import nn

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import ShardInfo
from flightdeck.events.commands import (
    CheckpointRequested,
    PauseRequested,
    ResumeRequested,
    RollbackRequested,
    StopRequested,
)
from flightdeck.events.nodelocal import RESTORE_REFUSED_EXIT, STOPPED_EXIT
from flightdeck.events.plan import ParallelPlan, coordinates, unplanned
from flightdeck.events.spec import JobSpec
from flightdeck.events.training import FaultInjected, RankStarted, SnapshotsOff
from flightdeck.trainer import (
    checkpointing,
    exactness,
    faults,
    loaders,
    modelinfo,
    restore_points,
    rollback,
    seeding,
    snapshots,
)
from flightdeck.trainer.config import RunConfig
from flightdeck.trainer.cursor import BatchCursor, Step
from flightdeck.trainer.distributed import Dist
from flightdeck.trainer.lastboundary import LastBoundary
from flightdeck.trainer.link import PLAN_WAIT_S, AgentSide, admitted
from flightdeck.trainer.replay import Replay
from flightdeck.trainer.reports import SPIKE_FACTOR, Emitter, StepReporter, check_metric_names, checked_value
from flightdeck.trainer.snapshotting import Cadence
from flightdeck.trainer.state import Stateful, TrainState
from flightdeck.trainer.usage import refused

T = TypeVar("T")
log = structlog.get_logger("trainer")
PAUSE_POLL_S = 0.2


class Run:
    """One rank of a job. Made by `flightdeck.init()`; see trainer/api.py for the calls a script makes."""

    def __init__(self, cfg: RunConfig, dist: Dist, emitter: Emitter, inbox: AgentSide) -> None:
        self.cfg, self.dist, self.emitter, self.inbox = cfg, dist, emitter, inbox
        self.job_id, self.attempt = cfg.job_id, cfg.attempt
        self.rank, self.world_size, self.local_rank = dist.rank, dist.world_size, cfg.local_rank
        self.device: torch.device = dist.device
        self.spec: JobSpec = cfg.spec
        self._plan: ParallelPlan | None = cfg.plan
        self.step = 0  # steps done: the index of the next step
        self.cursor = BatchCursor()
        self.faults = faults.Faults(cfg.spec.faults, dist.rank, cfg.attempt, cfg.fired)
        self.state = TrainState(None, None, {}, rank=dist.rank, device=dist.device)
        self.ckpt = checkpointing.Checkpointer(job_id=cfg.job_id, staging=cfg.staging, dist=dist,
                                               emit=emitter.emit, envelope=emitter.envelope)
        self.reporter = StepReporter(emitter, dist.device)
        self.snapshots: Cadence | None = None  # host snapshots in the node's memory (train.snapshot_every)
        if cfg.snapshots is not None and cfg.spec.train.snapshot_every > 0:
            snaps = snapshots.Snapshots(cfg.snapshots, job_id=cfg.job_id, attempt=cfg.attempt, rank=dist.rank,
                                        world_size=dist.world_size, recent=emitter.recent_steps)
            self.snapshots = Cadence(snaps, every=cfg.spec.train.snapshot_every,
                                     max_overhead=cfg.spec.train.snapshot_max_overhead, off=self._snapshots_off)
        self.last = LastBoundary(self.snapshots, lambda: self.reporter.step_times, emitter.beat_now,
                                 leave=self._leave_stuck) \
            if self.snapshots and self.device.type == "cpu" else None  # what a failed step can still snapshot
        self.restored_from = ""
        self.exactness = ""  # why the restore may part from the uninterrupted run ("": it does not)
        self.saved_at: int | None = None  # the boundary whose state is already checkpointed
        self.paused = False
        self.sigterm = False
        self._dying = threading.Lock()  # one thread leaves the process: the main one, or the SIGTERM watcher
        self.restored = False
        self.finished = False  # the step loop ended or stopped cleanly: the process group may be torn down
        self.stepping = self.looping = False  # steps() was entered; its loop has not ended
        self.ran_all = False  # steps() ran to its last step
        self.failed = False  # an uncaught exception ends the process (exits.fail_hook): its own exit code stands
        self.stopped = False  # told to stop, or SIGTERM: it exits STOPPED_EXIT
        self.closed = False
        self._current: tuple[int, int, float] | None = None  # the step being run: (step, batch, started)
        self.replay: Replay | None = None  # a rollback's diagnostic re-run of the spike's batches, under way
        self._lr_boost = 1.0  # a drill's high_lr factor, applied around the optimizer's step
        self._reported = False
        self._spike = False
        self._nan = False
        self._names: set[frozenset[str]] = set()  # metric-name sets already checked
        self._cmd_decoder = msgspec.msgpack.Decoder(list[bytes])
        self._seed: int | None = None  # the script's seed of this rank, before any restore (trainer/seeding.py)

    # -- what a script calls -------------------------------------------------------------------------

    def register(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **extras: Stateful) -> None:
        """The state a checkpoint holds; call once, before `restore()` or `steps()`."""
        if self.restored:
            raise refused(RuntimeError("register(...) comes before restore() and steps(): the state to restore "
                                       "into must be known first"))
        self.state = TrainState(model, optimizer, extras, rank=self.rank, device=self.device)
        self._seed = seeding.base()
        plan, described = self._plan, None
        if model is not None and plan is not None and plan.pp > 1 and self.dist.ctl_group is not None:
            at = coordinates(plan, self.rank)  # a stage's blocks only: the model is the stages' sum
            first = at["dp"] == at["tp"] == 0
            described = modelinfo.across_stages(modelinfo.describe(model), first, self.dist.ctl_group)
        if self.rank == 0:  # the planner learns the model and the batch it is fed (trainer/modelinfo.py)
            modelinfo.watch(model, optimizer, self.emitter.emit, self.emitter.envelope, self.world_size,
                            lambda: self._plan.dp if self._plan is not None else self.world_size, described)
        if optimizer is not None:
            # its step is the first write to state that a snapshot being copied beside training may still read
            optimizer.register_step_pre_hook(lambda *_: self._before_update())
            if any(f.kind == "high_lr" for f in self.spec.faults):  # a drill's learning rate too high, then restored
                optimizer.register_step_pre_hook(lambda opt, *_: faults.scale_lr(opt, self._lr_boost))
                optimizer.register_step_post_hook(lambda opt, *_: faults.scale_lr(opt, 1.0 / self._lr_boost))

    def restore(self) -> int:
        """Load the checkpoint this attempt starts from, if any; returns the step to start from (0: none)."""
        if self.restored:
            return self.step
        self.restored = True
        _ = self.seed  # taken now if not at register: a restore sets the generator (and its seed) to the checkpoint's
        path = self.cfg.restore
        if path is None and self.cfg.resume_local:
            path = restore_points.newest_local(self.cfg.staging / self.job_id, self.dist)
        if path is not None:
            try:
                # Its manifest too: once a peer refused the checkpoint, the agent may have deleted the node's copy.
                manifest = self.cfg.manifest if path == self.cfg.restore else None
                self._load(path, checkpointing.read_manifest(manifest) if manifest is not None else None)
            except checkpointing.CorruptCheckpoint as exc:
                if not (self.cfg.platform and path == self.cfg.restore):
                    raise
                log.error("restore refused: its checkpoint is bad; nothing was loaded", checkpoint=str(path),
                          error=str(exc))
                self._die(RESTORE_REFUSED_EXIT)
            self.restored_from = ("memory" if snapshots.is_snapshot(path) and self.cfg.snapshots is not None
                                  and path.is_relative_to(self.cfg.snapshots) else
                                  "store" if path == self.cfg.restore else "local")
            for start, end in self.cfg.restore_skips if path == self.cfg.restore else ():
                self.cursor.skip(start, end)  # a rollback decided back to this checkpoint: its batches stay skipped
            if self.cfg.restore_skips:
                log.info("restored with the skip windows of rollbacks to it", skips=self.cfg.restore_skips)
            self.saved_at = self.step
            if not self.cfg.restore_model_only or path != self.cfg.restore:
                self.exactness = exactness.why_inexact(self.state.loaded_meta, self.world_size, self._layout(),
                                                       self.state.borrowed)
            log.info("restored", checkpoint=str(path), step=self.step, **(
                {"inexact": self.exactness} if self.exactness else {}))
        return self.step

    def steps(self, total: int | None = None) -> Iterator[Step]:
        """The steps to run, from where `restore()` left off up to `total` (default: the spec's train.steps)."""
        total = self.spec.train.steps if total is None else total
        self.stepping = True
        self.restore()
        self.emitter.emit(RankStarted(world_size=self.world_size, from_step=self.step, device=str(self.device),
                                      restored_from=self.restored_from, exactness=self.exactness,
                                      schema_version=2 if self.exactness else 1, **self.emitter.envelope))
        if self.cfg.snapshots_off and self.spec.train.snapshot_every > 0:  # the grant found its node no room
            self._snapshots_off(self.cfg.snapshots_off)
        self.emitter.set_step(self.step - 1)
        self.looping = True
        while True:
            if self.snapshots is not None:
                self.snapshots.copied()  # a step without the optimizer's: nothing past here may read a torn copy
            if self.last is not None:
                self.last.drop()
            if self.replay is not None and self.step >= self.replay.until:
                rollback.end_replay(self)  # every rank reaches it at the same step
            if self.world_size == 1 or self.paused or self.step % self.cfg.sync_every == 0:
                self._boundary()
            if self.paused:
                self.emitter.flush()
                time.sleep(PAUSE_POLL_S)
                continue
            if self.step > 0 and self.step % self.spec.train.checkpoint_every == 0:
                self._checkpoint()
            if self.step >= total:
                break
            self._snapshot()
            step, index, started = self.step, self.cursor.next_index(), time.perf_counter()
            self._before_step(step, index)  # a drill's slow rank sleeps here: part of the step's time
            self._current, self._reported = (step, index, started), False
            seeding.seed_step(self.seed, step)
            yield Step(step, index)
            self.reporter.end_step(step, started, self._reported)  # its report goes out now, with its whole time
            self._current = None
            self.step = step + 1
        self.looping = False
        self.reporter.flush()
        self.ckpt.wait()
        if self.snapshots is not None:
            self.snapshots.close()
        self.finished = self.ran_all = True
        log.info("training finished", steps=self.step)

    def batches(self, loader: Iterable[T], total: int | None = None) -> Iterator[tuple[Step, T]]:
        """`steps(total)`, each step with `loader`'s batch for its global batch index (trainer/loaders.py)."""
        return loaders.batches(self, loader, total)

    def report(self, step: int, loss: torch.Tensor | float, *, grad_norm: torch.Tensor | float | None = None,
               lr: float | None = None, tokens: int | None = None, **metrics: torch.Tensor | float) -> None:
        """Publish one step's loss and metrics. Tensors are read later (never a host sync on CUDA)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise refused(TypeError(f"report(step=...) takes the int step from steps(), "
                                    f"got {type(step).__name__}"))
        values: dict[str, torch.Tensor | float] = {"loss": checked_value("loss", loss)}
        if grad_norm is not None:  # else none: "not reported", never a made-up 0
            values["grad_norm"] = checked_value("grad_norm", grad_norm)
        if metrics:
            names = frozenset(metrics)
            if names not in self._names:
                check_metric_names(names)
                self._names.add(names)
            for name, value in metrics.items():
                values[name] = checked_value(name, value)
        scale = 1.0
        current = self._current
        started = current[2] if current is not None and current[0] == step else time.perf_counter()
        if current is not None and current[0] == step:
            scale = float("nan") if self._nan else SPIKE_FACTOR if self._spike else 1.0
            self._reported = True
        if self.replay is not None:  # a diagnostic re-run: its losses go to SpikeReplayed, not the step record
            self.replay.record(int(step), float(values["loss"]) * scale)
            self.emitter.set_step(int(step), time.perf_counter() - started)
            return
        self.reporter.record(int(step), values, lr=float("nan" if lr is None else lr), running=current is not None
                             and current[0] == step, tokens=float("nan" if tokens is None else tokens),
                             started=started, scale=scale)  # NaN: not reported, never a made-up 0

    @property
    def seed(self) -> int:
        """The seed the script gave this rank, as the trainer API took it at `register` (trainer/seeding.py)."""
        if self._seed is None:
            self._seed = seeding.base()
        return self._seed

    @property
    def plan(self) -> ParallelPlan:
        """The parallel layout Flightdeck recorded for this world size (known at the start, or passed on by the agent
        when the resharder records it); without one (no resharder, no platform) the spec's [parallel] layout nearest
        to what the world holds, or plain data parallelism."""
        if self._plan is None:
            recorded = self.inbox.plan(self.world_size, PLAN_WAIT_S) if self.cfg.platform else None
            self._plan = recorded or unplanned(self.world_size, self.spec.parallel.tp, self.spec.parallel.pp,
                                               self.spec.train.batch_size)
            log.info("parallel plan", recorded=recorded is not None, plan=msgspec.to_builtins(self._plan))
        return self._plan

    def close(self) -> None:
        """Flush telemetry and wait for a checkpoint being written; `init()` arranges this at exit."""
        if self.closed:
            return
        self.closed = True
        try:
            self.reporter.flush()
            self.ckpt.wait()
            if self.snapshots is not None:
                self.snapshots.close()
        finally:
            self.emitter.close()
        if self.finished:
            self.dist.close()  # only when the peers are healthy: tearing down a broken group can block
        log.info("rank exiting", finished=self.finished)

    # -- step boundaries -----------------------------------------------------------------------------

    def install_signals(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            self.sigterm = True

        signal.signal(signal.SIGTERM, on_term)

    def _before_step(self, step: int, index: int) -> None:
        self._nan = self._spike = False
        for i, fault in self.faults.due(step, index):
            self._inject(fault.kind, step, i)
        self._spike = self.faults.poisoned(index)
        self._lr_boost = self.faults.lr_factor(step)
        delay = self.faults.slow_seconds(step)
        if delay:
            time.sleep(delay)

    def _inject(self, kind: str, step: int, index: int) -> None:
        """Announce a drill fault, then act on it. The announcement is what a later attempt's agent reads to keep an
        unpinned fault from firing again (a crash flushes it before the exit that causes the restart)."""
        self.emitter.emit(FaultInjected(kind=kind, step=step, fault=index, schema_version=2,  # type: ignore[arg-type]
                                        **self.emitter.envelope))
        log.warning("injecting drill fault", kind=kind, step=step)
        if kind == "crash":
            self.reporter.flush()
            self.emitter.crash(faults.CRASH_EXIT_CODE)
        if kind == "hang":
            self.reporter.flush()
            self.emitter.flush()
            faults.hang(lambda: self.sigterm)
            if self.last is not None:
                self.last.take("a drill's hang, stopped by SIGTERM")
            self._die(faults.HANG_EXIT_CODE)
        if kind == "nonfinite":
            self._nan = True
        if kind == "corrupt":
            faults.corrupt(self.state.model, self.faults.spec(index).factor or faults.CORRUPT_SCALE)

    def _leave_stuck(self) -> None:
        """Stuck in a step after a SIGTERM (the watcher): leave as stopped, unless writing a checkpoint or done."""
        if self.looping and not self.ckpt.writing:
            self._die(STOPPED_EXIT)

    def _die(self, code: int) -> NoReturn:
        """Leave at once, flushed first, as a killed process would; a second thread on its way out waits for it."""
        if not self._dying.acquire(blocking=False):
            threading.Event().wait()
        self.emitter.close(timeout=3.0)
        os._exit(code)

    def _stop(self) -> NoReturn:
        """Leave before the last step, cleanly (its checkpoint written): not a completion (STOPPED_EXIT)."""
        self.reporter.flush()
        self.ckpt.wait()
        self.finished = self.stopped = True
        raise SystemExit(STOPPED_EXIT)

    def _boundary(self) -> None:
        payload = b""
        if self.rank == 0:
            polled = self.inbox.poll()
            if polled:
                payload = msgspec.msgpack.encode([codec.encode(c) for c in polled])
        spacing = self.snapshots.spacing(self.reporter.step_times) if self.snapshots is not None else 1
        (sigterm, orphaned, spacing), payload = self.dist.agree([int(self.sigterm), int(self.inbox.gone), spacing],
                                                                payload)
        if self.snapshots is not None:
            self.snapshots.agreed(spacing)  # the costliest rank's: every rank snapshots the same steps
        commands = admitted(self._cmd_decoder.decode(payload)) if payload else []
        for command in commands:
            self._obey(command)
        if orphaned:  # no agent to publish a checkpoint or hear this rank: its work could never be kept
            log.error("a node agent of this job is gone: stopping without a checkpoint", step=self.step)
            self.reporter.flush()
            self.finished = self.stopped = True
            raise SystemExit(STOPPED_EXIT)
        if sigterm:
            log.warning("SIGTERM: checkpointing before exit (preemption)", step=self.step)
            self._checkpoint(wait=True)
            self._stop()

    def _obey(self, command: Event) -> None:
        log.info("command", type=type(command).__name__, step=self.step)
        match command:
            case CheckpointRequested():
                self._checkpoint()
            case StopRequested(checkpoint=save):
                if save:
                    self._checkpoint(wait=True)
                self._stop()
            case PauseRequested():
                self.paused = True
            case ResumeRequested():
                self.paused = False
            case RollbackRequested():
                rollback.roll_back(self, command)
            case _:
                log.warning("ignoring a command this trainer does not know", type=type(command).__name__)

    def _checkpoint(self, *, wait: bool = False) -> None:
        if self.replay is not None:  # a re-run's state is thrown away: it is never saved
            return
        if self.saved_at != self.step:
            self.ckpt.save(self.step, self.state.live(), self.cursor.position(), self._layout())
            self.saved_at = self.step
        if wait:
            self.ckpt.wait()

    def _snapshot(self) -> None:
        """This boundary's state into the node's memory when it is due, else held for a snapshot after a failure
        (trainer/lastboundary.py); never a re-run's."""
        if self.snapshots is None or self.replay is not None:
            return
        if self.snapshots.due(self.step):
            if self.device.type != "cuda":  # the steps it holds go on record first (on CPU it costs nothing)
                self.reporter.flush()
            self.snapshots.take(self.step, self.state.live, self.cursor.position(), self.world_size,
                                timeline=self.ckpt.timeline, checkpointing_=self.saved_at == self.step,
                                settled=self.state.settled, layout=self._layout(),
                                generation=lambda: self.state.generation)
        elif self.last is not None:  # none on a GPU, where a step not due once took a snapshot all the same
            self.last.hold(self.step, self.state.live, self.cursor.position(), self.world_size,
                           timeline=self.ckpt.timeline, checkpointing_=self.saved_at == self.step,
                           settled=self.state.settled, layout=self._layout())

    def _layout(self) -> tuple[int, int, int]:
        """DP x TP x PP as this rank runs: its plan's when it asked for one, else plain data parallelism."""
        plan = self._plan
        return (plan.dp, plan.tp, plan.pp) if plan is not None else (self.world_size, 1, 1)

    def _before_update(self) -> None:
        self.ckpt.before_update()
        if self.last is not None:
            self.last.drop()  # after a copy of the held state under way: the step waits for it
        if self.snapshots is not None:
            self.snapshots.copied()

    def _snapshots_off(self, reason: str) -> None:
        self.emitter.emit(SnapshotsOff(step=self.step, reason=reason[:2000], **self.emitter.envelope))

    def _load(self, path: Path, shards: list[ShardInfo] | None) -> None:
        model_only = self.cfg.restore_model_only and path == self.cfg.restore
        step, position = checkpointing.load(path, self.state, self.dist, shards, model_only=model_only)
        if not model_only:  # another job's weights to start from: this run's own steps begin at 0
            self.step = step
            self.cursor.seek(position)
