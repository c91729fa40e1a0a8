"""Heartbeats batched per node: what one node agent publishes each interval for every rank of a job it runs.

At fleet scale one JetStream message per rank per second is more than one broker stores with
`sync_interval: always` (about 1-2.6k messages/s on the 2-core box, bench/results/cpu-scale-sim.json), so an
agent may gather its ranks' heartbeats and publish them as one `RankHeartbeats` per node per interval. The
health monitor folds each entry exactly as it folds a rank's own Heartbeat (the batch's event id is the
evidence a finding cites), plus the step time of the rank's newest step, which is what straggler and hang
detection need from the ranks that no longer publish a StepCompleted per step.

Subject: `fd.tel.<job>.<rank>.RankHeartbeats`, where `rank` is the lowest rank the agent runs for the job on
that node (the node's "subject rank"), so the subject grammar, its checks and a job's publish permission
(`fd.tel.<job>.>`) stay as they are. A rank missing from a batch has not beaten since the previous one.
"""

import msgspec

from events.base import RankEvent


class RankBeat(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's newest heartbeat as its agent saw it."""

    rank: int
    step: int  # last completed step, as a Heartbeat carries it
    occurred_at: float  # when the rank beat (its own clock), not when the batch left
    step_time_s: float = 0.0  # that step's duration; 0 when not known (no step completed yet)


class RankHeartbeats(RankEvent, frozen=True, kw_only=True):
    """The heartbeats of a node's ranks of one job and attempt since the agent's previous batch; `rank` is the
    node's subject rank (its lowest), `node` the agent's node."""

    interval_s: float
    beats: list[RankBeat]
