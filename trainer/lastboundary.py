"""A snapshot taken after a failure, of the step boundary before it (as Just-In-Time checkpointing, EuroSys 2024,
takes one from the survivors): when a peer's death breaks this rank's collective, the rank's own step raises, or the
rank is stopped (SIGTERM) while stuck in a step, its parameters and optimizer state are still those of the newest
boundary, since only the optimizer's step writes them. Regular snapshots (trainer/snapshotting.py) are spaced out by
their cost; this one costs a reference to the state at each boundary, and bounds what such a failure redoes to the
step in flight.

At a boundary the cadence did not snapshot, `hold` keeps what a snapshot of that step needs: the live state's items,
the settled ones (parameters, optimizer state: TrainState.settled) by reference and the rest captured now (buffers
cloned, RNG, extras packed, the optimizer's groups), with the step's data position. The optimizer's pre-step hook
and the next boundary `drop` it. `take` copies it into the node's slots under a lock the pre-step hook takes too,
so an optimizer step that resumes meanwhile waits for the copy rather than tear it. CPU ranks only (Run makes none
on CUDA, where no item is settled: TrainState.settled).
"""

import contextlib
import copy
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from flightdeck.events.checkpoint import DataPosition
from flightdeck.trainer.snapshotting import Cadence

log = structlog.get_logger("trainer")
STUCK_WAIT_MAX_S = 1.0  # a SIGTERM'd rank not at a boundary by then is taken as stuck (the agent's grace is longer)
STUCK_WAIT_MIN_S = 0.2
# ... and one still stuck this many step times after its snapshot (1 s at least) leaves: its agent persists the
# snapshot once it has exited, and would otherwise SIGKILL it only after its grace (30 s by default)
STUCK_LEAVE_STEPS = 3


@dataclass(frozen=True)
class Held:
    step: int
    items: dict[str, Any]
    position: DataPosition
    world_size: int
    timeline: int
    checkpointing: bool
    layout: tuple[int, int, int]


class LastBoundary:
    def __init__(self, cadence: Cadence, step_times: Callable[[], list[float]],
                 told: Callable[[], None] = lambda: None, leave: Callable[[], None] | None = None) -> None:
        """`told`: tell the agent the steps done (Emitter.beat_now), once a snapshot after a failure is written;
        `leave`: end the process, as stopped, when a SIGTERM finds it stuck (from the watcher's thread)."""
        self.cadence, self.step_times, self.told, self.leave = cadence, step_times, told, leave
        self.lock = threading.Lock()
        self._held: Held | None = None
        self.moves = 0  # boundaries and optimizer steps passed: a SIGTERM'd rank that passes one is not stuck
        self.hold_s = 0.0  # the newest hold's cost to the loop (its thread's CPU seconds)
        self.taken: int | None = None  # the step of the snapshot taken after a failure
        self._wake: tuple[int, int] | None = None  # the SIGTERM watcher's pipe (read, write)
        self._watcher: threading.Thread | None = None
        self._relay = -1  # the wakeup fd the rank's own code had set (an asyncio loop's): what arrives goes on to it

    def drop(self) -> None:
        """The state is about to change (the optimizer's step, the next boundary): nothing held stands for it."""
        with self.lock:
            self._held = None
            self.moves += 1
        self._reclaim()

    def hold(self, step: int, live: Callable[[], dict[str, Any]], position: DataPosition, world_size: int, *,
             timeline: int, checkpointing_: bool, layout: tuple[int, int, int],
             settled: Callable[[dict[str, Any]], frozenset[str]]) -> None:
        """Keep this boundary's state (call where a snapshot would be taken, when none was). Skipped while a hold
        costs more than the snapshots' share of a step (`train.snapshot_max_overhead`), or nothing is settled."""
        cad = self.cadence
        if cad.snaps is None or cad.snapped_at == step:
            return
        times = self.step_times()[-5:]
        if times and cad.max_overhead < 1.0 and self.hold_s > statistics.median(times) * cad.max_overhead:
            self.hold_s /= 2  # tried again in a few steps: one slow hold (the first, a busy moment) is not the rule
            cad.holding_s = 0.0
            return
        started = time.thread_time()  # its own work: on a busy box the wall clock counts other threads' turns
        items = live()
        keep = settled(items)
        if not keep:
            return
        held = {k: v if k in keep else v.clone() if isinstance(v, torch.Tensor) else
                v if isinstance(v, (bytes, str, int, float)) else copy.deepcopy(v) for k, v in items.items()}
        with self.lock:
            self._held = Held(step, held, position, world_size, timeline, checkpointing_, layout)
        self.hold_s = cad.holding_s = time.thread_time() - started  # the snapshots' spacing counts it

    def take(self, why: str) -> int | None:
        """Snapshot the held boundary into the node's slots now, complete with its header; its step, or None when
        nothing is held (the optimizer stepped since, or the cadence snapshotted it already) or the write failed.
        Never raises: it runs on the way out of a failed rank."""
        with self.lock:
            held, cad = self._held, self.cadence
            if held is None or cad.snaps is None or cad.snapped_at == held.step:
                log.info("no snapshot of the last boundary after a failure", why=why,
                         reason="snapshots are off" if cad.snaps is None else "nothing held (the optimizer stepped "
                         "since, the cadence snapshotted the step, or holds cost too much)" if held is None else
                         "the cadence's own snapshot holds it", moves=self.moves,
                         hold_ms=round(self.hold_s * 1e3, 3))
                return None
            started = time.perf_counter()
            try:
                cad.take(held.step, lambda: dict(held.items), held.position, held.world_size,
                         timeline=held.timeline, checkpointing_=held.checkpointing, layout=held.layout)
                cad.written()  # the agent persists only complete slots
                self.told()  # ... of steps on its record: the last step's report may be a beat away
            except Exception as exc:
                log.error("the snapshot of the last boundary failed", step=held.step, why=why, error=repr(exc))
                return None
            self._held = None
            if cad.snapped_at != held.step or cad.snaps is None:
                return None  # the write failed: Cadence said why (SnapshotsOff)
            self.taken = held.step
        log.warning("snapshot of the last boundary taken after a failure", step=held.step, why=why,
                    seconds=round(time.perf_counter() - started, 4))
        return held.step

    def watch_sigterm(self) -> None:
        """On SIGTERM, from a thread of its own (the main thread may be stuck in a collective, where Python runs no
        signal handler): if the step loop reaches no boundary within a step or two, the rank is taken as stuck and
        its last boundary is snapshotted. The main thread's own handler still runs when it can (Run.sigterm)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._wake = (read, write)
        self._watcher = threading.Thread(target=self._watch, args=(read,), name="sigterm-watch", daemon=True)
        self._watcher.start()

    def _reclaim(self) -> None:
        """Take the wakeup fd back where the rank's own code set one (an asyncio loop's signal handlers do: a SIGTERM
        while stuck then went unseen), relaying to it what arrives. Only the main thread may; its loop calls this
        every step. Their loop's `set_wakeup_fd(-1)` on close comes before it closes its fd, so a relay found
        replaced by -1 is dropped before anything could be written to a reused fd number."""
        if self._wake is None or threading.current_thread() is not threading.main_thread():
            return
        was = signal.set_wakeup_fd(self._wake[1], warn_on_full_buffer=False)
        if was != self._wake[1]:
            if was >= 0 and was != self._relay:
                log.info("the rank's code set its own signal wakeup fd: SIGTERM watched again, relayed to it", fd=was)
            self._relay = was

    def unwatch(self) -> None:
        """Stop watching (the process's wakeup fd goes back to the rank's own, or none)."""
        if self._wake is not None:
            was = signal.set_wakeup_fd(-1)
            back = self._relay if was == self._wake[1] else was  # theirs, whether relayed or set since
            if back >= 0:
                with contextlib.suppress(ValueError, OSError):
                    signal.set_wakeup_fd(back)
            os.close(self._wake[1])
            if self._watcher is not None:
                self._watcher.join()
            os.close(self._wake[0])
            self._wake = None

    def _watch(self, read: int) -> None:
        while True:
            try:
                got = os.read(read, 64)
            except OSError:
                return
            if not got:
                return
            if self._relay >= 0:
                with contextlib.suppress(OSError):  # full or gone: their loop's own business
                    os.write(self._relay, got)
            if signal.SIGTERM in got:
                self._stuck_or_not()

    def _stuck_or_not(self) -> None:
        seen, times = self.moves, self.step_times()[-5:]
        median = statistics.median(times) if times else 0.0
        wait_s = min(STUCK_WAIT_MAX_S, max(STUCK_WAIT_MIN_S, 2 * median))
        if self._moved(seen, wait_s):
            return  # the loop is moving: it checkpoints at its boundary, as a SIGTERM asks
        self.take(f"SIGTERM, and no step boundary within {wait_s:.2f}s")
        leave_s = max(STUCK_WAIT_MAX_S, STUCK_LEAVE_STEPS * median)
        if self.leave is not None and not self._moved(seen, leave_s):
            log.warning("SIGTERM while stuck in a step: leaving", step_wait_s=round(wait_s + leave_s, 2))
            self.leave()

    def _moved(self, seen: int, wait_s: float) -> bool:
        """Whether the loop passes a boundary or an optimizer step within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.moves != seen:
                return True
            time.sleep(0.02)
        return self.moves != seen
