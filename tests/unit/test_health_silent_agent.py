"""A node agent that relays its ranks' heartbeats sends a batch every interval while it runs them, empty when none
beat; when its batches stop, the node is lost at the ranks' lost deadline, in the same tick as (and before) the
RankLost of its rank, so the restart never lands on it again (services/health/agents.silent). A live agent
whose ranks hang or crash keeps batching: no NodeLost."""


import msgspec

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.commands import StopRequested
from flightdeck.events.findings import RankHung, RankLost
from flightdeck.events.fleet import NodeLost
from flightdeck.events.heartbeats import RankBeat, RankHeartbeats
from flightdeck.events.job import AllocationReleased, JobSubmitted, WorkersExited
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import StepCompleted
from flightdeck.services.core import Emit
from flightdeck.services.health.core import wants_tick
from tests.unit import test_health_lost_agent as lost_agent
from tests.unit.health_synth import SERVICE
from tests.unit.test_health_lost_agent import POLICY, grant, started, tick

KILLED_AT = 10.0


def batch(node: str, rank: int, at: float, beating: bool = True) -> RankHeartbeats:
    beats = [RankBeat(rank=rank, step=int(at * 2), occurred_at=at)] if beating else []
    return RankHeartbeats(job_id="j", rank=rank, attempt=0, node=node, interval_s=0.5, beats=beats,
                          event_id=f"b-{node}-{at:.2f}", occurred_at=at, producer=f"agent-{node}")


def begun(policy: PolicySpec = POLICY) -> list[Event]:
    """A 2-rank job submitted, granted on n1 and n2, and both ranks started at 0.1 s."""
    spec = JobSpec(name="j", slots=2, policy=policy, train=TrainSpec(steps=1000))
    return [JobSubmitted(job_id="j", spec=spec, event_id="sub", occurred_at=0.0),
            grant(0, ["n1", "n2"], 0.0), started(0, 0, "n1", 0.1), started(0, 1, "n2", 0.1)]


def run(*, n2_agent_dies: bool = False, n2_rank_hangs: bool = False, n2_rank_exits: bool = False,
        until: float = 16.0) -> list[Event]:
    events = begun()
    timed: list[tuple[float, Event]] = []
    for k in range(1, int(until * 2)):
        t = k / 2
        timed.append((t, batch("n1", 0, t)))
        if n2_agent_dies and t >= KILLED_AT:
            continue
        hung = n2_rank_hangs and t >= KILLED_AT
        timed.append((t, batch("n2", 1, t, beating=not hung)))
    if n2_rank_exits:
        timed.append((KILLED_AT, WorkersExited(job_id="j", node="n2", attempt=0, rank=1, exit_code=-9,
                                               event_id="exit-1", occurred_at=KILLED_AT)))
    timed += [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(0, int(until * 2))]
    return events + [ev for _, ev in sorted(timed, key=lambda p: p[0])]


def fold(events: list[Event], kinds: tuple[type, ...] = (NodeLost, RankLost)) -> list[tuple[Event, Emit]]:
    return lost_agent.fold(events, kinds)


def test_a_silent_agent_loses_its_node_at_the_lost_deadline_before_its_rank() -> None:
    found = fold(run(n2_agent_dies=True))
    kinds = [(type(e.event).__name__, getattr(e.event, "node", getattr(e.event, "rank", None))) for _, e in found]
    assert kinds == [("NodeLost", "n2"), ("RankLost", 1)]  # the node first: the recovery avoids it
    (at, lost), (at2, _) = found
    assert at is at2 and isinstance(at, ClockTick)
    last = KILLED_AT - 0.5  # n2's last batch
    deadline = POLICY.heartbeat_interval_s * POLICY.heartbeat_misses
    assert last + deadline < at.now <= last + deadline + 0.5  # the first tick past the deadline
    assert lost.subject == "fd.ctl.node.n2.NodeLost" and isinstance(lost.event, NodeLost)
    assert "its agent, which ran ranks of j, has sent no heartbeat batch for 2s" in lost.event.reason


def test_a_live_agent_whose_rank_hangs_keeps_its_node() -> None:
    assert [type(e.event).__name__ for _, e in fold(run(n2_rank_hangs=True))] == ["RankLost"]


def test_a_rank_that_exits_is_lost_and_its_node_is_not() -> None:
    found = fold(run(n2_agent_dies=True, n2_rank_exits=True))
    assert [type(e.event).__name__ for _, e in found] == ["RankLost"]


def test_the_same_history_folds_to_the_same_findings() -> None:
    assert [e.event for _, e in fold(run(n2_agent_dies=True))] == [e.event for _, e in fold(run(n2_agent_dies=True))]


def test_the_lost_node_drill_with_relayed_beats_is_concluded_at_the_lost_deadline_not_the_exit_deadline() -> None:
    """The peer rank fails first (its exit is recorded at once), the restart is granted on both nodes, and the dead
    node's agent neither records the old rank's exit nor starts the new one: with batches, NodeLost comes once n2's
    agent has been silent for the lost deadline, not EXIT_RECORD_S after the grant."""
    events = begun()
    timed: list[tuple[float, Event]] = []
    for k in range(1, 40):
        t = k / 2
        timed.append((t, batch("n1", 0, t)))  # n1's agent batches on (for attempt 0, then 1)
        if t < KILLED_AT:
            timed.append((t, batch("n2", 1, t)))
    timed += [(10.1, WorkersExited(job_id="j", node="n1", attempt=0, rank=0, exit_code=1, event_id="exit-0-0",
                                   occurred_at=10.1)),
              (10.2, grant(1, ["n1", "n2"], 10.2)), (10.3, started(1, 0, "n1", 10.3))]
    timed += [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(0, 40)]
    found = fold(events + [ev for _, ev in sorted(timed, key=lambda p: p[0])])
    [(at, lost)] = [(at, e) for at, e in found if isinstance(e.event, NodeLost)]
    assert isinstance(lost.event, NodeLost) and lost.event.node == "n2" and isinstance(at, ClockTick)
    assert KILLED_AT - 0.5 + 2.0 < at.now <= KILLED_AT - 0.5 + 2.5  # n2's last batch + the lost deadline


def test_a_silent_agent_of_an_attempt_being_stopped_is_lost_at_the_deadline_and_once() -> None:
    """Found by bench/vs_peers.py's lost node: the survivor's collective failed first, its exit stopped the attempt,
    and the monitor stopped ticking for a job being stopped, so n2's silence went unseen while the restart waited
    for the survivors' snapshots, which commit only once n2 is known lost (2.6 s of waiting, then a grant on the
    dead node). An agent still owes its ranks' exits while they are stopped: its silence is NodeLost at the lost
    deadline, and the next attempt's grant does not conclude it a second time."""
    events = begun()
    timed: list[tuple[float, Event]] = [(k / 2, batch("n1", 0, k / 2)) for k in range(1, 21)]
    timed += [(k / 2, batch("n2", 1, k / 2)) for k in range(1, 20)]  # n2's last batch at 9.5
    timed += [(10.1, WorkersExited(job_id="j", node="n1", attempt=0, rank=0, exit_code=1, event_id="exit-0-0",
                                   occurred_at=10.1)),
              (10.1, StopRequested(job_id="j", checkpoint=False, reason="rank 0 exited", event_id="stop",
                                   occurred_at=10.1)),
              (10.1, AllocationReleased(job_id="j", attempt=0, reason="rank 0 exited with code 1",
                                        event_id="release", occurred_at=10.1)),
              (13.0, grant(1, ["n1"], 13.0)), (13.1, started(1, 0, "n1", 13.1))]
    timed += [(k / 2, batch_of(1, "n1", 0, k / 2)) for k in range(27, 50)]
    state, ticks = SERVICE.initial, []
    for ev in events + [ev for _, ev in sorted(timed, key=lambda p: p[0])]:
        state, _ = SERVICE.transition(state, ev)
        if isinstance(ev, (StopRequested, AllocationReleased)):
            ticks.append(wants_tick(state, ev.occurred_at))
    assert ticks == [True, True]  # the monitor ticks on while n2's agent owes rank 1's exit
    timeline = events + [ev for _, ev in sorted(timed + [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(50)],
                                                key=lambda p: p[0])]
    found = fold(timeline)
    kinds = [(type(e.event).__name__, getattr(e.event, "node", getattr(e.event, "rank", None))) for _, e in found]
    # rank 0's own exit, then n2 once: not again for the next attempt, and no RankLost of the stopped rank 1
    assert kinds == [("RankLost", 0), ("NodeLost", "n2")]
    (_, _), (at, _) = found
    assert isinstance(at, ClockTick) and 9.5 + 2.0 < at.now <= 9.5 + 2.5  # before the restart's grant at 13.0


def batch_of(attempt: int, node: str, rank: int, at: float) -> RankHeartbeats:
    return RankHeartbeats(job_id="j", rank=rank, attempt=attempt, node=node, interval_s=0.5,
                          beats=[RankBeat(rank=rank, step=int(at * 2), occurred_at=at)],
                          event_id=f"b-{node}-{attempt}-{at:.2f}", occurred_at=at, producer=f"agent-{node}")


def test_an_idle_agent_given_new_ranks_is_not_lost_before_its_first_batch_is_due() -> None:
    """Silence counts from the ranks' start: an agent idle for a minute is not lost the moment it starts ranks."""
    events: list[Event] = [*run(until=5.0)[:4]]  # submitted, granted, both started at 0.1
    events += [batch("n2", 1, 0.5), tick(1.0)]
    later = [started(0, 1, "n2", 60.0)]  # the same attempt's rank started again much later (a standby hand-off)
    found = fold(events + later + [tick(60.5), tick(61.0), batch("n2", 1, 61.2), tick(62.0), tick(63.0)])
    assert [e for _, e in found if isinstance(e.event, NodeLost)] == []


def test_an_agent_that_never_acts_on_a_grant_loses_its_node_after_the_start_grace() -> None:
    """Found by the fault explorer (seed 67): an agent that died while it ran nothing was granted the restart's ranks,
    never started them, sent nothing, and the job waited for ever. After the start grace its node is lost, before
    its ranks, so the next restart goes elsewhere."""
    spec = JobSpec(name="j", slots=2, policy=POLICY, train=TrainSpec(steps=1000))
    grace = max(POLICY.startup_grace_s, POLICY.heartbeat_interval_s * POLICY.heartbeat_misses)
    events: list[Event] = [JobSubmitted(job_id="j", spec=spec, event_id="sub", occurred_at=0.0),
                           grant(0, ["n1", "n2"], 0.0), started(0, 0, "n1", 0.1)]
    timed = [(k / 2, batch("n1", 0, k / 2)) for k in range(1, int(grace * 2) + 6)]
    timed += [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(0, int(grace * 2) + 6)]
    found = fold(events + [ev for _, ev in sorted(timed, key=lambda p: p[0])])
    kinds = [(type(e.event).__name__, getattr(e.event, "node", getattr(e.event, "rank", None))) for _, e in found]
    assert kinds == [("NodeLost", "n2"), ("RankLost", 1)]
    (at, lost), (_, rank) = found
    assert isinstance(at, ClockTick) and grace < at.now <= grace + 0.5
    assert isinstance(lost.event, NodeLost) and "never started the ranks of j granted to it" in lost.event.reason
    assert isinstance(rank.event, RankLost) and "never started it" in rank.event.reason


def test_a_rank_that_hangs_after_its_last_step_is_found_hung_after_the_start_grace() -> None:
    """Found by the fault explorer (seed 827): a rank done with its steps that never exits (a hang in a final
    collective or teardown) kept beating, was never judged, and its job never ended."""
    steps = 20
    spec = JobSpec(name="j", slots=2, policy=POLICY, train=TrainSpec(steps=steps))
    grace = max(POLICY.startup_grace_s, POLICY.hang_min_s)
    events: list[Event] = [JobSubmitted(job_id="j", spec=spec, event_id="sub", occurred_at=0.0),
                           grant(0, ["n1", "n2"], 0.0), started(0, 0, "n1", 0.1), started(0, 1, "n2", 0.1),
                           WorkersExited(job_id="j", node="n1", attempt=0, rank=0, exit_code=0, event_id="done-0",
                                         occurred_at=1.0)]
    def beat(at: float) -> RankHeartbeats:  # still alive, still at its last step
        return RankHeartbeats(job_id="j", rank=1, attempt=0, node="n2", interval_s=0.5, event_id=f"b-{at:.2f}",
                              beats=[RankBeat(rank=1, step=steps - 1, occurred_at=at)], occurred_at=at)

    last = StepCompleted(job_id="j", rank=1, attempt=0, node="n2", step=steps - 1, loss=1.0, grad_norm=1.0, lr=1e-3,
                         tokens_per_s=1.0, step_time_s=0.1, event_id="last-step", occurred_at=1.0)
    timed: list[tuple[float, Event]] = [(1.0, last), *((k / 2, beat(k / 2)) for k in range(3, int(grace * 2) + 8))]
    timed += [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(2, int(grace * 2) + 8)]
    found = fold(events + [ev for _, ev in sorted(timed, key=lambda p: p[0])], (RankHung, RankLost, NodeLost))
    assert [(type(e.event).__name__, getattr(e.event, "rank", None)) for _, e in found] == [("RankHung", 1)]
    (at, hung), = found
    assert isinstance(at, ClockTick) and grace < at.now - 1.0 <= grace + 1.0  # the first tick past it, a beat on
    assert isinstance(hung.event, RankHung) and hung.event.step == steps - 1 and hung.event.deadline_s == grace


# A pipeline's policy (examples/tp_pp): a node is lost after 12 missed batches (6 s), later than a hang (3 s).
SLOW_LOSS = msgspec.structs.replace(POLICY, heartbeat_misses=12)


def stranded(*, n2_back_at: float | None = None, until: float = 20.0) -> list[Event]:
    """n1's rank 0 beats on but makes no progress from KILLED_AT (stuck in a collective with rank 1); n2's agent
    sends no batch from KILLED_AT, or again from `n2_back_at`."""
    events = begun(SLOW_LOSS)
    timed: list[tuple[float, Event]] = []
    for k in range(1, int(until * 2)):
        t = k / 2
        step = int(min(t, KILLED_AT) * 2)
        timed.append((t, RankHeartbeats(job_id="j", rank=0, attempt=0, node="n1", interval_s=0.5,
                                        beats=[RankBeat(rank=0, step=step, occurred_at=t, step_time_s=0.25)],
                                        event_id=f"b-n1-{t:.2f}", occurred_at=t, producer="agent-n1")))
        if t < KILLED_AT or (n2_back_at is not None and t >= n2_back_at):
            timed.append((t, batch("n2", 1, t, beating=t < KILLED_AT)))
    timed += [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(0, int(until * 2))]
    return events + [ev for _, ev in sorted(timed, key=lambda p: p[0])]


def test_ranks_stranded_by_a_lost_node_are_not_blamed_for_it() -> None:
    """Found by the TP/PP drill: n2's agent was killed, n1's ranks stalled in a collective with n2's, and with the
    lost deadline (6 s) past the hang deadline (3 s) the monitor found rank 0 hung first; the restart was recorded as
    a hang, and the postmortem told no lost node. The stall waits on the quiet node: NodeLost comes first."""
    found = fold(stranded(), (NodeLost, RankLost, RankHung))
    kinds = [(type(e.event).__name__, getattr(e.event, "node", getattr(e.event, "rank", None))) for _, e in found]
    assert kinds[0] == ("NodeLost", "n2") and ("RankLost", 1) in kinds, kinds  # rank 0's hang after it, if at all
    (at, _), *_ = found
    last = KILLED_AT - 0.5  # n2's last batch
    assert isinstance(at, ClockTick) and last + 6.0 < at.now <= last + 6.5  # at the lost deadline, not later


def test_a_hang_waits_for_a_quiet_node_only_until_it_is_heard_again() -> None:
    """n2's agent misses batches for 4.5 s, then batches again (its rank 1 silent, so lost at its own deadline);
    rank 0's hang (due at 13 s) is told at the first tick after n2 is heard, and n2 is not lost."""
    back = KILLED_AT + 4.5
    found = fold(stranded(n2_back_at=back), (NodeLost, RankLost, RankHung))
    kinds = [(type(e.event).__name__, getattr(e.event, "rank", None)) for _, e in found]
    assert ("NodeLost", None) not in kinds and ("RankHung", 0) in kinds, kinds
    (at,) = [at for at, e in found if isinstance(e.event, RankHung)]
    assert isinstance(at, ClockTick) and back < at.now <= back + 0.5, at.now


def test_a_history_recorded_before_the_wait_replays_its_hang_first() -> None:
    """Its CoreConfigured lacks the `stranded` setting: the hang is judged at its deadline, as it was recorded."""
    old = CoreConfigured(service="health", settings={"tick_s": 0.5, "stopping": "watched"}, event_id="cfg",
                         occurred_at=0.0)
    found = fold([old, *stranded()], (NodeLost, RankLost, RankHung))
    assert [type(e.event).__name__ for _, e in found][:2] == ["RankHung", "NodeLost"]
