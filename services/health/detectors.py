"""The health detectors: small state machines over one job's telemetry, judged with recorded time (loss spikes:
spikes.py).

Why it works this way: docs/internals.md, "6. The health monitor".
"""

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.window import median_without

STARTUP_GRACE_S = PolicySpec().startup_grace_s  # the default least time to a started rank's first sign of life
HANG_WINDOW = 16  # recent step times per rank behind its hang deadline
EVIDENCE_MAX = 32  # a straggler or spike finding names at most this many of its steps (the newest)


@dataclass(frozen=True, slots=True)
class Lost:
    rank: int
    reason: str
    last_seen: float
    evidence: tuple[str, ...]
    never_heard: bool = False  # no sign of life since its start (RankLost.never_heard)


@dataclass(frozen=True, slots=True)
class Hung:
    rank: int
    step: int
    stalled_s: float
    deadline_s: float
    evidence: tuple[str, ...]


def age(now: float, at: float, folded: float) -> float:
    return min(now - at, now - folded)


def lost_deadline(policy: PolicySpec) -> float:
    return policy.heartbeat_misses * policy.heartbeat_interval_s


def hang_deadline(policy: PolicySpec, step_times: deque[float]) -> float:
    if not step_times:
        return policy.hang_min_s
    return max(policy.hang_min_s, policy.hang_factor * statistics.median(step_times))


@dataclass(slots=True)
class RankWatch:
    """What liveness and hang detection know of one rank of the current attempt."""

    rank: int
    node: str = ""  # where its agent started it
    started_at: float = 0.0
    started_folded: float = 0.0
    started_id: str = ""  # WorkersStarted; "" while only granted
    seen_at: float = 0.0
    seen_folded: float = 0.0
    seen_id: str = ""  # the newest sign of life; "" before the first
    armed: bool = False  # the hang clock runs (RankStarted or a step seen)
    progress_at: float = 0.0
    progress_folded: float = 0.0
    progress_id: str = ""
    progress_step: int = -1
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=HANG_WINDOW))
    fault_id: str = ""  # the rank's last RankFault: evidence for the exit that usually follows
    gone: bool = False  # exited, found lost, or released: judged no more
    exited: bool = False  # its agent recorded its exit
    hung: bool = False  # RankHung reported
    granted_node: str = ""  # where its grant placed it: an agent that never starts it is gone
    granted_at: float = 0.0
    granted_folded: float = 0.0
    grant_id: str = ""
    # A step completed in this attempt: before the first, the rank is still starting (its imports, a sharded model's
    # set-up, the first step's warm-up), and only its start-up grace applies (an FSDP2 job under load was found hung
    # "at step -1" with hang_min_s 3)
    stepped: bool = False

    @property
    def live(self) -> bool:
        return not self.gone and bool(self.started_id or self.seen_id)

    def clone(self) -> "RankWatch":
        return RankWatch(self.rank, self.node, self.started_at, self.started_folded, self.started_id, self.seen_at,
                         self.seen_folded, self.seen_id, self.armed, self.progress_at, self.progress_folded,
                         self.progress_id, self.progress_step, self.step_times.copy(), self.fault_id, self.gone,
                         self.exited, self.hung, self.granted_node, self.granted_at, self.granted_folded,
                         self.grant_id, self.stepped)

    def granted(self, node: str, at: float, folded: float, event_id: str) -> None:
        self.granted_node, self.granted_at, self.granted_folded, self.grant_id = node, at, folded, event_id

    def never_started(self, policy: PolicySpec, now: float) -> bool:
        """Granted, and neither started nor heard of since for the start grace: its agent never acted on the
        grant (a live one starts the ranks or records why it could not)."""
        if self.gone or self.started_id or self.seen_id or self.exited or not self.grant_id:
            return False
        return age(now, self.granted_at, self.granted_folded) > max(policy.startup_grace_s, lost_deadline(policy))

    def started(self, at: float, folded: float, event_id: str) -> None:
        self.started_at, self.started_folded, self.started_id = at, folded, event_id

    def seen(self, at: float, folded: float, event_id: str) -> None:
        if at >= self.seen_at or not self.seen_id:
            self.seen_at, self.seen_id = at, event_id
        self.seen_folded = folded

    def progressed(self, step: int, at: float, folded: float, event_id: str) -> None:
        self.armed = True
        self.progress_step, self.progress_at, self.progress_folded, self.progress_id = step, at, folded, event_id

    def restart_clock(self, at: float, folded: float, event_id: str) -> None:
        """A pause ended or a rollback began: time before it is no stall."""
        if self.armed:
            self.progress_at, self.progress_folded, self.progress_id = at, folded, event_id

    def heartbeat(self, step: int, at: float, folded: float, event_id: str) -> None:
        self.seen(at, folded, event_id)
        # Moved, even backwards after a rollback; but a beat older than the newest progress is stale, not a
        # step back: an agent's batch (events/heartbeats.py) can land after the rank's own newer StepCompleted.
        if self.armed and step != self.progress_step and at >= self.progress_at:
            self.progressed(step, at, folded, event_id)

    def step_completed(self, step: int, step_time_s: float, at: float, folded: float, event_id: str) -> None:
        self.stepped = True
        self.seen(at, folded, event_id)
        self.progressed(step, at, folded, event_id)
        if math.isfinite(step_time_s) and step_time_s > 0:
            self.step_times.append(step_time_s)

    def judge(self, policy: PolicySpec, now: float, paused: bool, last_step: int = -1,
              recovered_at: float = 0.0) -> Lost | Hung | None:
        """Dead first: a rank with no sign of life is lost, whatever its step did. `last_step` is the job's
        final step (-1: not known); a rank that reported it is done. `recovered_at`: when the broker last came
        back from an outage the service saw; silence is counted on the service's clock from no earlier (ranks
        cannot publish while it is away, and resend their backlog only once their pending publishes time out)."""
        if self.gone:
            return None
        dead_after = lost_deadline(policy)
        done = last_step >= 0 and self.progress_step == last_step
        if self.seen_id:
            silent = age(now, self.seen_at, max(self.seen_folded, recovered_at))
            if done:
                if silent > max(policy.startup_grace_s, dead_after):
                    return Lost(self.rank, f"no exit within {silent:.0f}s of its last step", self.seen_at,
                                (self.seen_id,))
                # Alive and done, yet not gone: a hang on the way out (a final collective, a teardown) strands
                # the job as surely as one mid-run. Found by the fault explorer (seed 827).
                stalled = min(self.seen_at - self.progress_at, self.seen_folded - self.progress_folded)
                deadline = max(policy.startup_grace_s, hang_deadline(policy, self.step_times))
                if not paused and not self.hung and stalled > deadline:
                    return Hung(self.rank, self.progress_step, stalled, deadline, (self.progress_id, self.seen_id))
                return None
            if silent > dead_after:
                return Lost(self.rank, "heartbeats stopped", self.seen_at, (self.seen_id,))
        elif self.started_id:
            waited = age(now, self.started_at, self.started_folded)
            if waited > max(policy.startup_grace_s, policy.hang_min_s + dead_after):
                return Lost(self.rank, f"no heartbeat within {waited:.0f}s of start: it never called "
                            "flightdeck.init(), or was stuck before it", self.started_at, (self.started_id,),
                            never_heard=True)
            return None
        elif self.never_started(policy, now):
            waited = age(now, self.granted_at, self.granted_folded)
            return Lost(self.rank, f"its agent on {self.granted_node} never started it: no WorkersStarted within "
                        f"{waited:.0f}s of the grant", self.granted_at, (self.grant_id,))
        else:
            return None
        if paused or self.hung or not self.armed:
            return None
        # Stalled as far as the rank's own signs of life show: only a rank heard from after its deadline
        # has passed is hung. One silent since its last step is dead (judged above) or not yet judged.
        stalled = min(self.seen_at - self.progress_at, self.seen_folded - self.progress_folded)
        if stalled <= policy.hang_min_s:  # the least deadline: no median needed (the common case)
            return None
        deadline = hang_deadline(policy, self.step_times)
        if not self.stepped:
            deadline = max(deadline, policy.startup_grace_s)
        if stalled <= deadline:
            return None
        evidence = (self.progress_id,) if self.progress_id == self.seen_id else (self.progress_id, self.seen_id)
        return Hung(self.rank, self.progress_step, stalled, deadline, evidence)


class NonFiniteWatch:
    """Non-finite episodes of one job. With DDP a NaN on one rank reaches every rank's grad norm, so an
    episode is job-wide: it opens at the first non-finite step reported and takes in every non-finite
    report up to a finite step beyond it; a report for a step already covered is never new."""

    __slots__ = ("episodes", "last", "open")

    def __init__(self) -> None:
        self.last = -1  # the highest non-finite step seen
        self.open = False
        self.episodes = 0  # opened so far

    def clone(self) -> "NonFiniteWatch":
        c = NonFiniteWatch()
        c.last, c.open, c.episodes = self.last, self.open, self.episodes
        return c

    def reset(self) -> None:
        """Steps are about to be redone (a rollback): a NaN at a step seen before is news again."""
        self.last, self.open = -1, False

    def observe(self, step: int, finite: bool) -> bool:
        """True when this report opens a new episode (report it)."""
        if finite:
            if step > self.last:
                self.open = False
            return False
        if step <= self.last:
            return False
        new, self.open, self.last = not self.open, True, step
        self.episodes += new
        return new


@dataclass(frozen=True, slots=True)
class Straggle:
    rank: int
    step: int
    step_time_s: float
    peer_median_s: float
    factor: float
    episode: int
    evidence: tuple[str, ...]


@dataclass(slots=True)
class _Run:
    count: int = 0  # consecutive slow steps
    ids: deque[str] = field(default_factory=lambda: deque(maxlen=EVIDENCE_MAX))
    reported: bool = False
    episode: int = 0


class StragglerWatch:
    """Ranks whose step time stays above straggler_factor x the median of their peers' newest step times,
    straggler_window reports in a row (a step a rank did not report, e.g. dropped telemetry, neither
    extends nor ends its run). Peers' newest times rather than the same step's: that needs no waiting
    for the last rank of a step, and a straggler that falls steps behind its peers is still compared.
    Each rank's newest time sits in one sorted list, so a report costs O(log n) plus a memmove."""

    __slots__ = ("latest", "runs", "times")

    def __init__(self) -> None:
        self.latest: dict[int, float] = {}  # rank -> its newest step time
        self.times: list[float] = []  # the values of `latest`, sorted
        self.runs: dict[int, _Run] = {}

    def clone(self) -> "StragglerWatch":
        c = StragglerWatch()
        c.latest, c.times = dict(self.latest), list(self.times)
        c.runs = {rank: _Run(run.count, run.ids.copy(), run.reported, run.episode) for rank, run in self.runs.items()}
        return c

    def forget(self, rank: int) -> None:
        """A rank gone is no one's peer any more."""
        old = self.latest.pop(rank, None)
        if old is not None:
            del self.times[bisect.bisect_left(self.times, old)]

    def observe(self, rank: int, step: int, step_time_s: float, event_id: str, policy: PolicySpec) -> Straggle | None:
        if not (math.isfinite(step_time_s) and step_time_s >= 0):
            return None
        self.forget(rank)
        self.latest[rank] = step_time_s
        bisect.insort(self.times, step_time_s)
        if len(self.times) < 2:
            return None
        peers = median_without(self.times, bisect.bisect_left(self.times, step_time_s))
        run = self.runs.get(rank)
        if peers > 0 and step_time_s > policy.straggler_factor * peers:
            if run is None:
                run = self.runs[rank] = _Run()
            run.count += 1
            run.ids.append(event_id)
            if run.count >= policy.straggler_window and not run.reported:
                run.reported = True
                return Straggle(rank, step, step_time_s, peers, step_time_s / peers, run.episode, tuple(run.ids))
        elif run is not None and run.count:
            run.episode += run.reported
            run.count, run.reported = 0, False
            run.ids.clear()
        return None
