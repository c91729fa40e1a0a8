"""What a rank says about itself: an Emitter in front of the telemetry publisher (and an optional JSON-lines
log of the same events), and the StepReporter that turns each step's device tensors into StepCompleted
without a host sync on CUDA: values are copied to pinned memory without blocking and read a step later."""

import math
import os
import threading
import time
from pathlib import Path
from typing import IO, Any, Protocol

import msgspec
import torch

from events import codec
from events.base import RankEvent
from events.training import RankFault, StepCompleted
from trainer.telemetry import uuid4_hex


class Publisher(Protocol):
    """The part of trainer.telemetry.Telemetry the loop uses."""

    def emit(self, event: RankEvent) -> None:
        """Queue one event without blocking."""

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        """The step the heartbeat reports, and its duration (0: not known)."""

    def close(self, timeout: float = 5.0) -> None:
        """Flush and stop."""


class Emitter:
    """Stamps and forwards a rank's events. StepCompleted is handed to the publisher in batches at most
    every `batch_s`: each hand-over may wake the publisher thread, whose turn on the GIL the step pays for.
    With `steps_to_bus` False (a fleet whose ranks heartbeat through their agents, rank > 0) StepCompleted
    goes only to the events log: the step and its time reach the health monitor in the agent's batches."""

    def __init__(self, publisher: Publisher, envelope: dict[str, Any], events_log: Path | None = None, *,
                 batch_s: float = 0.25, steps_to_bus: bool = True) -> None:
        self.publisher = publisher
        self.steps_to_bus = steps_to_bus
        self.envelope = envelope  # job_id, rank, attempt, node: every event this rank emits carries them
        self.batch_s = batch_s
        self._lock = threading.Lock()
        self._held: list[RankEvent] = []
        self._last_flush = time.monotonic()
        self._log: IO[bytes] | None = None
        if events_log is not None:
            events_log.parent.mkdir(parents=True, exist_ok=True)
            self._log = events_log.open("ab", buffering=0)

    def emit(self, event: RankEvent) -> None:
        """Stamp here, so the published event and the logged one carry the same id and time."""
        event = msgspec.structs.replace(event, event_id=event.event_id or uuid4_hex(),
                                        occurred_at=event.occurred_at or time.time(), producer="trainer")
        if self._log is not None:
            line = codec.to_json(codec.to_builtins(event)) + b"\n"
            with self._lock:
                self._log.write(line)
        if not self.steps_to_bus and isinstance(event, StepCompleted):
            return
        with self._lock:
            self._held.append(event)
            if isinstance(event, StepCompleted) and time.monotonic() - self._last_flush < self.batch_s:
                return
            self._forward()

    def flush(self) -> None:
        """Hand over held steps now: the loop calls this before it blocks (pause, hang, exit)."""
        with self._lock:
            self._forward()

    def _forward(self) -> None:
        for event in self._held:
            self.publisher.emit(event)
        self._held.clear()
        self._last_flush = time.monotonic()

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        self.publisher.set_step(step, step_time_s)

    def close(self, timeout: float = 5.0) -> None:
        self.flush()
        self.publisher.close(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    def crash(self, code: int) -> None:
        """Die at once like a crashed process, once what was emitted is flushed."""
        self.close(timeout=3.0)
        os._exit(code)


class StepReporter:
    def __init__(self, emitter: Emitter, device: torch.device, local_tokens: int) -> None:
        self.emitter = emitter
        self.cuda = device.type == "cuda"
        self.local_tokens = local_tokens
        self.step_times: list[float] = []
        self.losses: dict[int, float] = {}
        self._last_report = time.perf_counter()
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event, float, float] | None = None
        self._host = [torch.empty(2, dtype=torch.float32, pin_memory=self.cuda) for _ in range(2)]

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, started: float) -> None:
        values = torch.stack([loss.float(), grad_norm.float()])
        if not self.cuda:
            a, b = values.tolist()
            self._report(step, a, b, lr, started)
            return
        host = self._host[step % 2]
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        previous, self._pending = self._pending, (step, host, done, lr, started)
        if previous is not None:
            self._finish(previous)

    def flush(self) -> None:
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._finish(previous)

    def _finish(self, pending: tuple[int, torch.Tensor, torch.cuda.Event, float, float]) -> None:
        step, host, done, lr, started = pending
        done.synchronize()  # waits for that step only; the next one is already queued behind it
        a, b = host.tolist()
        self._report(step, a, b, lr, started)

    def _report(self, step: int, loss: float, grad_norm: float, lr: float, started: float) -> None:
        now = time.perf_counter()
        # From the later of the step's start and the previous report: on CUDA a step's work overlaps the
        # host's wait for the step before it, and a pause or checkpoint before the step is not its time.
        step_time = now - max(started, self._last_report)
        self._last_report = now
        self.step_times.append(step_time)
        self.losses[step] = loss
        env = self.emitter.envelope
        self.emitter.emit(StepCompleted(step=step, loss=loss, grad_norm=grad_norm, lr=lr,
                                        tokens_per_s=self.local_tokens / step_time if step_time > 0 else 0.0,
                                        step_time_s=step_time, **env))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.emitter.emit(RankFault(kind="nonfinite", error_type="NonFiniteLoss", step=step,
                                        message=f"loss {loss}, grad norm {grad_norm} at step {step}: "
                                                "the optimizer step was skipped on every rank", **env))
        self.emitter.set_step(step, step_time)
