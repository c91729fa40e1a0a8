"""Lost node agents, told by the heartbeat batches they stop sending, or by the exits they fail to record.

Why it works this way: docs/internals.md, "6. The health monitor".
"""

from dataclasses import dataclass, replace

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeLost
from flightdeck.events.spec import PolicySpec
from flightdeck.services.core import Emit
from flightdeck.services.health.detectors import RankWatch, age, lost_deadline

EXIT_RECORD_S = 10.0  # least time an agent is given to record the exits of ranks it was told to kill
OVERDUE_BATCHES = 2  # an agent this many batches late may be gone: its job's stalled ranks wait on it


@dataclass(frozen=True, slots=True)
class Unrecorded:
    """A started rank of a replaced attempt with no recorded exit yet."""

    job_id: str
    attempt: int
    rank: int
    node: str
    since_at: float  # the grant of the attempt that replaced it (its occurred_at, and when it was folded)
    since_folded: float
    seen_at: float  # the rank's last sign of life, or its start
    seen_folded: float
    started_id: str  # WorkersStarted
    seen_id: str  # its last sign of life ("" if none)
    grant_id: str  # the grant that replaced its attempt

    @property
    def evidence(self) -> tuple[str, ...]:
        return tuple(i for i in (self.started_id, self.seen_id, self.grant_id) if i)


def silent(batches: dict[str, tuple[float, float]], suspects: dict[str, tuple[float, float]], policy: PolicySpec,
           now: float, recovered_at: float) -> list[str]:
    """The `suspects` (node -> since when it runs a job's ranks: (occurred_at, folded)) whose agent has sent no
    heartbeat batch for the lost deadline, counted from that time and from a broker outage's end at the earliest.
    Only nodes whose agent batched before: an agent relays its ranks' beats and, while it runs ranks, sends a
    batch every interval even when none beat; one that stops is gone with its ranks."""
    return _quiet_for(batches, suspects, lost_deadline(policy), now, recovered_at)


def overdue_batches(batches: dict[str, tuple[float, float]], suspects: dict[str, tuple[float, float]],
                    policy: PolicySpec, now: float, recovered_at: float) -> list[str]:
    """The `suspects` whose agent has missed OVERDUE_BATCHES batches, lost or not (yet)."""
    return _quiet_for(batches, suspects, OVERDUE_BATCHES * policy.heartbeat_interval_s, now, recovered_at)


def _quiet_for(batches: dict[str, tuple[float, float]], suspects: dict[str, tuple[float, float]], seconds: float,
               now: float, recovered_at: float) -> list[str]:
    out = []
    for node in sorted(suspects.keys() & batches.keys()):
        (b_at, b_folded), (s_at, s_folded) = batches[node], suspects[node]
        if age(now, max(b_at, s_at, recovered_at), max(b_folded, s_folded, recovered_at)) > seconds:
            out.append(node)
    return out


def idle_silent(batches: dict[str, tuple[float, float]], idle: set[str], reported: set[str], deadline_s: float,
                now: float, recovered_at: float) -> list[str]:
    """Nodes whose agent, running no ranks, has sent no sign of life (AgentAlive) for `deadline_s`, counted from a
    broker outage's end at the earliest; not those already declared lost and not heard from since."""
    quiet = {n: (0.0, 0.0) for n in idle - reported}
    return _quiet_for(batches, quiet, deadline_s, now, recovered_at)


def idle_node(node: str, last_at: float, deadline_s: float) -> Emit:
    reason = f"its agent, running no ranks, has sent no sign of life for {deadline_s:g}s (last at {last_at:.3f})"
    return Emit(subjects.node(node, "NodeLost"), NodeLost(node=node, reason=reason))


def silent_node(node: str, job_id: str, last_at: float, policy: PolicySpec) -> Emit:
    reason = (f"its agent, which ran ranks of {job_id}, has sent no heartbeat batch for {lost_deadline(policy):g}s "
              f"(last at {last_at:.3f})")
    return Emit(subjects.node(node, "NodeLost"), NodeLost(node=node, reason=reason))


def never_started(node: str, job_id: str, policy: PolicySpec) -> Emit:
    reason = (f"its agent never started the ranks of {job_id} granted to it, nor said why, within "
              f"{max(policy.startup_grace_s, lost_deadline(policy)):g}s")
    return Emit(subjects.node(node, "NodeLost"), NodeLost(node=node, reason=reason))


def exit_deadline(policy: PolicySpec) -> float:
    return max(EXIT_RECORD_S, lost_deadline(policy))


def left_behind(job_id: str, attempt: int, ranks: list[RankWatch], grant_at: float, now: float,
                grant_id: str) -> dict[tuple[int, int], Unrecorded]:
    """The started ranks of `attempt`, replaced by a grant, that no agent recorded as exited."""
    out = {}
    for r in ranks:
        if r.started_id and not r.exited and r.node:
            seen_at, seen_folded = (r.seen_at, r.seen_folded) if r.seen_id else (r.started_at, r.started_folded)
            out[(attempt, r.rank)] = Unrecorded(
                job_id=job_id, attempt=attempt, rank=r.rank, node=r.node, since_at=grant_at, since_folded=now,
                seen_at=seen_at, seen_folded=seen_folded, started_id=r.started_id, seen_id=r.seen_id,
                grant_id=grant_id)
    return out


def heard(pending: dict[tuple[int, int], Unrecorded], attempt: int, rank: int, at: float, now: float,
          event_id: str) -> None:
    """A replaced attempt's rank is still talking: its node is not lost (yet)."""
    u = pending.get((attempt, rank))
    if u is not None and at >= u.seen_at:
        pending[(attempt, rank)] = replace(u, seen_at=at, seen_folded=now, seen_id=event_id)


def overdue(pending: dict[tuple[int, int], Unrecorded], policy: PolicySpec, now: float,
            alive: set[str], recording: dict[str, tuple[float, float]] | None = None) -> list[Emit]:
    """NodeLost for each node with an overdue rank, once: the node's entries are dropped from `pending`.
    `alive`: nodes whose agent started ranks of the current attempt. `recording`: node -> when its agent last
    recorded an exit of a replaced attempt; the deadline runs from then, since an agent still recording is
    alive (one rank's WorkersExited at a time into one job history: 2,048 of them outlast EXIT_RECORD_S)."""
    deadline = exit_deadline(policy)
    recording = recording or {}

    def since(u: Unrecorded) -> float:
        at, folded = recording.get(u.node, (u.since_at, u.since_folded))
        return age(now, max(at, u.since_at), max(folded, u.since_folded))

    late = [u for u in pending.values() if u.node not in alive
            and since(u) > deadline and age(now, u.seen_at, u.seen_folded) > deadline]
    out: list[Emit] = []
    for node in sorted({u.node for u in late}):
        u = min((u for u in late if u.node == node), key=lambda u: (u.attempt, u.rank))
        reason = (f"its agent recorded no exit of rank {u.rank} of {u.job_id} (attempt {u.attempt}) within "
                  f"{deadline:.0f}s of the grant that replaced it, and the rank has been silent as long "
                  f"(evidence: {', '.join(u.evidence)})")
        out.append(Emit(subjects.node(node, "NodeLost"), NodeLost(node=node, reason=reason)))
        for key in [k for k, v in pending.items() if v.node == node]:
            del pending[key]
    return out
