"""Drill faults from JobSpec.faults: which fire on this rank in this attempt, and when.

    crash       exit with CRASH_EXIT_CODE at the step
    hang        stop stepping at the step (heartbeats go on) until SIGTERM
    loss_spike  global batches [step, step + SPIKE_BATCHES) are poisoned: every rank's reported loss for them is
                multiplied by trainer.reports.SPIKE_FACTOR; a rollback that skips that window removes it,
                which is the recovery being drilled
    nonfinite   the rank reports a NaN loss at the step
    slow        the rank sleeps `seconds` per step from the step on
A fault pinned to an attempt (`attempt = N`) fires only in it. An unpinned one fires once, in the first attempt
that reaches its step: the node agent passes the indices of those an earlier attempt fired ($FLIGHTDECK_FIRED_FAULTS,
read from the job's FaultInjected events), and they stay quiet; without the platform (a torchrun restart) there is
no agent to ask, and an unpinned fault fires in the first run only. Within an attempt each fires at most once, except
`slow` (every step from its step on) and the spike's noisy data.
"""

import time
from collections.abc import Callable

from events.spec import FaultSpec

CRASH_EXIT_CODE = 3
HANG_EXIT_CODE = 143  # a hung rank told to stop exits as if SIGTERM had killed it: it saved nothing
SPIKE_BATCHES = 3


def live(faults: list[FaultSpec], attempt: int, fired: frozenset[int]) -> list[tuple[int, FaultSpec]]:
    """The faults that may fire in `attempt`, with their indices in the spec: pinned to it, or unpinned and not
    fired by an earlier attempt."""
    return [(i, f) for i, f in enumerate(faults)
            if f.attempt == attempt or (f.attempt is None and i not in fired)]


class Faults:
    def __init__(self, faults: list[FaultSpec], rank: int, attempt: int, fired: frozenset[int] = frozenset()) -> None:
        armed = live(faults, attempt, fired)
        self.mine = [(i, f) for i, f in armed if f.rank == rank]
        # The spike is a property of the data, which every rank shares; only the named rank reports it.
        self.poison = [(f.step, f.step + SPIKE_BATCHES) for _, f in armed if f.kind == "loss_spike"]
        self._fired: set[int] = set()

    def due(self, step: int, batch_index: int) -> list[tuple[int, FaultSpec]]:
        """Faults to announce and act on before running `step` (which reads `batch_index`), with their indices."""
        out = []
        for i, f in self.mine:
            at = batch_index if f.kind == "loss_spike" else step
            if i not in self._fired and f.step == at:
                self._fired.add(i)
                out.append((i, f))
        return out

    def poisoned(self, batch_index: int) -> bool:
        return any(a <= batch_index < b for a, b in self.poison)

    def slow_seconds(self, step: int) -> float:
        return sum(f.seconds for _, f in self.mine if f.kind == "slow" and f.step <= step)


def hang(stop: Callable[[], bool], poll_s: float = 0.2) -> None:
    """Block like a stuck collective would, until `stop()` says the rank was told to go."""
    while not stop():
        time.sleep(poll_s)
