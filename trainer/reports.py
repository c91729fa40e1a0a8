"""What a rank says about itself: an Emitter in front of the telemetry publisher (and an optional JSON-lines
log of the same events), and the StepReporter that turns each step's device tensors into StepCompleted
without a host sync on CUDA: values are copied to pinned memory without blocking and read a step later."""

import dataclasses
import math
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import IO, Any, Protocol

import msgspec
import torch

from flightdeck.events import codec
from flightdeck.events.base import RankEvent
from flightdeck.events.snapshot import RECENT_STEPS
from flightdeck.events.training import RankFault, StepCompleted
from flightdeck.trainer.link import uuid4_hex
from flightdeck.trainer.usage import refused


class Publisher(Protocol):
    """The part of flightdeck.trainer.link.AgentLink the loop uses."""

    def emit(self, event: RankEvent) -> None:
        """Queue one event without blocking."""

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        """The step the heartbeat reports, and its duration (0: not known)."""

    def beat_now(self) -> None:
        """Send that step to the agent now."""

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
        # The newest step reports, for each host snapshot's header: reports still in transit when the node's agent
        # dies with its ranks are published again by the agent that persists the snapshot (events/snapshot.py).
        self._recent: deque[bytes] = deque(maxlen=RECENT_STEPS)  # encoded once, as sent
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
            if isinstance(event, StepCompleted):
                self._recent.append(codec.encode(event))
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

    def recent_steps(self) -> list[bytes]:
        """The newest RECENT_STEPS step reports this rank sent towards the bus, oldest first, encoded."""
        with self._lock:
            return list(self._recent)

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        self.publisher.set_step(step, step_time_s)

    def beat_now(self) -> None:
        self.publisher.beat_now()

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


SPIKE_FACTOR = 10.0  # a drill's loss spike multiplies the reported loss of the poisoned batches


class StepReporter:
    """Turns each step's values (loss, grad norm, the script's metrics: tensors or numbers) into StepCompleted.
    On CUDA the tensors are stacked and copied to pinned memory without blocking, and read one step later."""

    def __init__(self, emitter: Emitter, device: torch.device) -> None:
        self.emitter = emitter
        self.cuda = device.type == "cuda"
        self.step_times: list[float] = []
        self.losses: dict[int, float] = {}
        self._last_report = time.perf_counter()
        self._open: _Open | None = None  # the running step's report (CPU), sent when the step ends: timed whole
        self._pending: _Pending | None = None
        self._host: dict[int, list[torch.Tensor]] = {}  # by number of tensor values: two pinned buffers each

    def record(self, step: int, values: dict[str, torch.Tensor | float], *, lr: float, tokens: float,
               started: float, scale: float = 1.0, running: bool = False) -> None:
        """`values` holds "loss", "grad_norm" (when the script reported one) and the custom metrics; `scale` is
        applied to the loss when it is read (a drill's spike, or NaN). `running`: the report is of the step running
        now, which goes out once the step ends (`end_step`), timed from its start to its end: a script may report
        before its step's work is done (an ETA of "4 ms" came from timing such a step up to its report)."""
        if not self.cuda:
            read = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
            if self._open is not None:  # a second report of one step: the first goes out as it stands
                self._report(*self._open.args())
                self._open = None
            if running:
                self._open = _Open(step, read, lr, tokens, started, scale)
                return
            self._report(step, read, lr, tokens, started, scale)
            return
        names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
        host: torch.Tensor | None = None
        if names:
            stacked = torch.stack([values[k].detach().float().reshape(()) for k in names])  # type: ignore[union-attr]
            pair = self._host.setdefault(len(names), [torch.empty(len(names), dtype=torch.float32, pin_memory=True)
                                                      for _ in range(2)])
            host = pair[step % 2]
            host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        plain = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
        previous, self._pending = self._pending, _Pending(step, names, host, plain, done, lr, tokens, started, scale)
        if previous is not None:
            self._finish(previous)

    def end_step(self, step: int, started: float, reported: bool) -> None:
        """Step `step`, started at `started` (perf_counter), has ended here. Its report, if the script made one, goes
        out with the step's whole time (on CUDA with the next step's, once its values are read); a step it did not
        report still shows on the heartbeat."""
        took = time.perf_counter() - started
        if not reported:
            self.emitter.set_step(step, took)
        elif self._open is not None and self._open.step == step:
            self._report(*self._open.args(), took=took)
            self._open = None
        elif self._pending is not None and self._pending.step == step:
            self._pending = dataclasses.replace(self._pending, took=took)

    def flush(self) -> None:
        if self._open is not None:
            self._report(*self._open.args())
            self._open = None
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._finish(previous)

    def _finish(self, p: "_Pending") -> None:
        p.done.synchronize()  # waits for that step only; the next one is already queued behind it
        read: dict[str, float] = dict(p.plain)
        if p.host is not None:
            read.update(zip(p.names, p.host.tolist(), strict=True))
        self._report(p.step, read, p.lr, p.tokens, p.started, p.scale, took=p.took)

    def _report(self, step: int, values: dict[str, float], lr: float, tokens: float, started: float,
                scale: float, took: float | None = None) -> None:
        now = time.perf_counter()
        # `took`: the step's whole time, as it ended. Otherwise from the later of the step's start and the previous
        # report: a pause or checkpoint before the step is not its time.
        step_time = took if took is not None else now - max(started, self._last_report)
        self._last_report = now
        self.step_times.append(step_time)
        loss = float(values.pop("loss")) * scale
        norm = values.pop("grad_norm", None)
        grad_norm = None if norm is None else float(norm)
        self.losses[step] = loss
        env = self.emitter.envelope
        metrics = {k: float(v) for k, v in values.items()}
        self.emitter.emit(StepCompleted(step=step, loss=loss, grad_norm=grad_norm, lr=lr,
                                        tokens_per_s=tokens if math.isnan(tokens) else
                                        tokens / step_time if step_time > 0 else 0.0,
                                        step_time_s=step_time, metrics=metrics,
                                        schema_version=3 if grad_norm is None else 2 if metrics else 1, **env))
        if not (math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))):
            self.emitter.emit(RankFault(kind="nonfinite", error_type="NonFiniteLoss", step=step,
                                        message=f"loss {loss}, grad norm {grad_norm} at step {step}", **env))
        self.emitter.set_step(step, step_time)


@dataclass(frozen=True)
class _Open:
    step: int
    values: dict[str, float]
    lr: float
    tokens: float
    started: float
    scale: float

    def args(self) -> tuple[int, dict[str, float], float, float, float, float]:
        return self.step, self.values, self.lr, self.tokens, self.started, self.scale


@dataclass(frozen=True)
class _Pending:
    step: int
    names: list[str]
    host: torch.Tensor | None
    plain: dict[str, float]
    done: torch.cuda.Event
    lr: float
    tokens: float
    started: float
    scale: float
    took: float | None = None  # the step's whole time, once it ended


METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,63}\Z")
RESERVED_METRICS = frozenset({"loss", "grad_norm"})


def checked_value(name: str, value: object) -> torch.Tensor | float:
    """A value `report` takes: a number, or a one-element tensor (read later); else a TypeError naming it."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise refused(ValueError(f"report({name}=...) takes one number; got a tensor of shape "
                                     f"{tuple(value.shape)}"))
        return value
    if isinstance(value, Real) and not isinstance(value, bool):
        return float(value)
    raise refused(TypeError(f"report({name}=...) takes a number or a one-element tensor, "
                            f"got {type(value).__name__}"))


def check_metric_names(names: frozenset[str]) -> None:
    """Custom metric names a StepCompleted may carry (codec.BOUNDS checks them again on every read)."""
    if len(names) > codec.MAX_METRICS:
        raise refused(ValueError(f"report(...) takes at most {codec.MAX_METRICS} custom metrics, "
                                 f"got {len(names)}"))
    for name in names:
        if name in RESERVED_METRICS or not METRIC_NAME.match(name):
            raise refused(ValueError(f"report(...): metric name {name!r} must match {METRIC_NAME.pattern} "
                             f"and not be one of {sorted(RESERVED_METRICS)}"))
