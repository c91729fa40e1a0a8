"""Goodput: the job's wall time split into useful training and the parts of badput, adding up exactly.

Why it works this way: docs/internals.md, "8. Operator tools".
"""

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from flightdeck.events.job import AllocationGranted, JobCancelled, JobCompleted, JobFailed, JobQueued, JobSubmitted
from flightdeck.services.tools.postmortem.incidents import Incident
from flightdeck.services.tools.postmortem.scan import Scan

PARTS = ("detection", "restart", "restore", "checkpoint_stall", "redone", "useful", "startup", "queued",
         "shutdown", "idle")
BADPUT = tuple(p for p in PARTS if p != "useful")

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    parts: dict[str, float]  # every name of PARTS, seconds
    edges: Floats  # the painted timeline: segment i is [edges[i], edges[i+1]) labelled PARTS[labels[i]]
    labels: npt.NDArray[np.int64]

    @property
    def goodput(self) -> float:
        return self.parts["useful"] / self.wall_s if self.wall_s > 0 else 0.0


def final_mask(steps: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Which completions (in time order) stand: the last completion of each step number."""
    if steps.size == 0:
        return np.zeros(0, dtype=bool)
    _, last_from_end = np.unique(steps[::-1], return_index=True)
    mask = np.zeros(steps.size, dtype=bool)
    mask[steps.size - 1 - last_from_end] = True
    return mask


def end_of(sc: Scan) -> float:
    """When the job ended (its last event if it has not), in seconds from its start."""
    t0 = sc.t0
    ends = [c.known for c in sc.control if isinstance(c.event, JobCompleted | JobFailed | JobCancelled)]
    if ends:
        return ends[0] - t0
    last = [c.known for c in sc.control[-1:]] + [float(sc.lead.end[-1])] * bool(len(sc.lead))
    return max(last, default=t0) - t0


def _stalls(sc: Scan, ends: Floats) -> tuple[Floats, Floats]:
    """Checkpoint stalls: each rank's stall_s from the end of rank 0's latest completion of the step before the
    checkpoint that precedes the staging. Ranks overlap there, so the painted stall is the slowest rank's."""
    lead = sc.lead
    if not sc.staged or not len(lead):
        return np.zeros(0), np.zeros(0)
    key = lead.attempt * (1 << 32) + lead.step + 1  # the checkpoint that follows each completed step
    order = np.lexsort((lead.end, key))
    keys, done = key[order], lead.end[order]
    begin, stop = [], []
    for s in sc.staged:
        k = (s.attempt << 32) + s.step
        lo, hi = np.searchsorted(keys, k, "left"), np.searchsorted(keys, k, "right")
        j = lo + int(np.searchsorted(done[lo:hi], s.occurred_at, "right")) - 1
        if j >= lo:
            at = float(ends[order[j]])
            begin.append(at)
            stop.append(at + s.stall_s)
    return np.asarray(begin, dtype=np.float64), np.asarray(stop, dtype=np.float64)


def _waits(sc: Scan, wall_end: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Queue waits (queued or submitted until granted) and start-ups (granted until the attempt's first step)."""
    t0, lead = sc.t0, sc.lead
    queued: list[tuple[float, float]] = []
    startup: list[tuple[float, float]] = []
    since: float | None = None
    for c in sc.control:
        ev, at = c.event, c.known - t0
        if isinstance(ev, JobSubmitted | JobQueued) and since is None:
            since = at
        elif isinstance(ev, AllocationGranted):
            if since is not None:
                queued.append((since, at))
                since = None
            first = np.flatnonzero(lead.attempt == ev.attempt)
            startup.append((at, float(lead.start[first[0]]) - t0 if first.size else wall_end))
    if since is not None:
        queued.append((since, wall_end))
    return queued, startup


def goodput(sc: Scan, found: list[Incident]) -> Goodput:
    t0, lead = sc.t0, sc.lead
    wall = max(end_of(sc), 0.0)
    starts, ends = lead.start - t0, lead.end - t0
    final = final_mask(lead.step)
    stall_b, stall_e = _stalls(sc, ends)
    queued, startup = _waits(sc, wall)
    last_step = float(ends.max()) if ends.size else wall
    acted = [i for i in found if i.decision != "none"]
    layers: dict[str, tuple[Floats, Floats]] = {
        "detection": _pairs([(i.fault_at, i.detected_at) for i in acted]),
        "restart": _pairs([(i.detected_at, i.restart_end) for i in acted]),
        "restore": _pairs([(i.restart_end, i.restore_end) for i in acted]),
        "checkpoint_stall": (stall_b, stall_e),
        "redone": (starts[~final], ends[~final]),
        "useful": (starts[final], ends[final]),
        "startup": _pairs(startup),
        "queued": _pairs(queued),
        "shutdown": _pairs([(last_step, wall)]),
    }
    edges, labels = paint(0.0, wall, [layers[p] for p in PARTS[:-1]])
    seconds = np.bincount(labels, weights=np.diff(edges), minlength=len(PARTS))
    return Goodput(wall_s=wall, parts={p: float(seconds[k]) for k, p in enumerate(PARTS)}, edges=edges,
                   labels=labels)


def _pairs(spans: list[tuple[float, float]]) -> tuple[Floats, Floats]:
    a = np.asarray([s for s, _ in spans], dtype=np.float64)
    b = np.asarray([e for _, e in spans], dtype=np.float64)
    return a, b


def paint(lo: float, hi: float, layers: list[tuple[Floats, Floats]]) -> tuple[Floats, npt.NDArray[np.int64]]:
    """Label every instant of [lo, hi] with the first layer covering it (len(layers) when none does).
    Returns the segment boundaries and one label per segment; segment lengths telescope to hi - lo."""
    clipped = [(np.clip(a, lo, hi), np.clip(b, lo, hi)) for a, b in layers]
    edges = np.unique(np.concatenate([np.asarray([lo, hi]), *(x for ab in clipped for x in ab)]))
    n = max(edges.size - 1, 0)
    labels = np.full(n, len(layers), dtype=np.int64)
    for k, (a, b) in enumerate(clipped):
        keep = b > a
        if not keep.any():
            continue
        i, j = np.searchsorted(edges, a[keep]), np.searchsorted(edges, b[keep])
        depth = np.cumsum(np.bincount(i, minlength=n + 1) - np.bincount(j, minlength=n + 1))[:n]
        labels[(labels == len(layers)) & (depth > 0)] = k
    return edges, labels
