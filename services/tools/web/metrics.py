"""The Prometheus exposition of `Figures` (figures.py) with prometheus-client: a custom collector, so every scrape
renders what the event log says now, and nothing is counted twice or kept in a second set of books.

The metric names are the contract of infra/prometheus/alerts.yml and infra/grafana/flightdeck.json (a test holds
every name they use to one this exports). A job is labelled `job_id`: Prometheus gives `job` to the scrape target.
An ended job's series are exported for ENDED_SERIES_S after its end, then no more: a series that outlived its job would
keep an alert on it (FlightdeckJobFailed) firing for ever, and every scrape would grow with the fleet's past."""

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from flightdeck.events import subjects
from flightdeck.services.tools.history.jobview import ENDED, PHASES
from flightdeck.services.tools.web.figures import Figures, JobAnalysis, JobFigures


def covering(j: JobFigures) -> JobAnalysis | None:
    """The job's postmortem analysis; for an ended job only one that covers its whole history: one taken before the
    end lacks its last commits and incidents, and a scraper that sees the end would read it as final (the demo's
    commit count did). A running job keeps its last one, at most ANALYSE_S behind."""
    if j.analysis is None or (j.view.phase in ENDED and j.stale):
        return None
    return j.analysis


DETECT_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300)
RECOVER_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ENDED_SERIES_S = 3600.0  # an ended job's series stay this long past its end (its alerts fire, then resolve)


def exported(f: Figures, now: float) -> list[tuple[str, JobFigures]]:
    """The jobs a scrape at `now` reports: every job that has not ended, and those that ended ENDED_SERIES_S ago or
    less (the dashboard lists them longer: figures.KEEP_ENDED)."""
    return [(k, j) for k, j in f.jobs.items() if not j.view.ended or now - j.view.ended_at <= ENDED_SERIES_S]


@dataclass
class Live:
    """What the server knows besides the event log: whether it reaches the broker, and each service's consumer
    lag (messages of FD_CONTROL its durable consumer has yet to take)."""

    broker_up: bool = False
    lag: dict[str, int] = field(default_factory=dict)


def histogram(name: str, doc: str, labels: Sequence[str], buckets: Sequence[float],
              series: Iterable[tuple[Sequence[str], Sequence[float]]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    for values, samples in series:
        finite = [s for s in samples if math.isfinite(s)]
        counts = [sum(1 for s in finite if s <= b) for b in buckets]
        family.add_metric(list(values), [*((repr(float(b)), c) for b, c in zip(buckets, counts, strict=True)),
                                         ("+Inf", len(finite))], sum(finite))
    return family


class FiguresCollector(Collector):
    def __init__(self, figures: Figures, live: Live, now: float) -> None:
        self.figures, self.live, self.now = figures, live, now

    def collect(self) -> Iterator[Metric]:
        f, live = self.figures, self.live
        up = GaugeMetricFamily("flightdeck_broker_up", "1 while the server reaches the broker")
        up.add_metric([], 1.0 if live.broker_up else 0.0)
        yield up
        jobs = exported(f, self.now)
        yield from self._jobs(jobs)
        yield from self._incidents(jobs)
        yield from self._services(f, live)
        yield from self._nodes(f)

    @staticmethod
    def _jobs(jobs: list[tuple[str, JobFigures]]) -> Iterator[Metric]:
        phase = GaugeMetricFamily("flightdeck_job_phase", "1 for the phase the job is in", labels=["job_id", "phase"])
        step = GaugeMetricFamily("flightdeck_job_step", "steps done, as its ranks report", labels=["job_id"])
        planned = GaugeMetricFamily("flightdeck_job_steps_planned", "the spec's steps", labels=["job_id"])
        world = GaugeMetricFamily("flightdeck_job_world_size", "ranks granted to its attempt", labels=["job_id"])
        steps = CounterMetricFamily("flightdeck_job_steps", "rank 0's step completions, redone ones too",
                                    labels=["job_id"])
        rate = GaugeMetricFamily("flightdeck_job_steps_per_second", "1 / rank 0's newest step time", labels=["job_id"])
        tokens = CounterMetricFamily("flightdeck_job_tokens", "tokens rank 0 trained on", labels=["job_id"])
        tps = GaugeMetricFamily("flightdeck_job_tokens_per_second", "rank 0's newest throughput", labels=["job_id"])
        loss = GaugeMetricFamily("flightdeck_job_loss", "rank 0's newest loss (NaN: none, or not finite)",
                                 labels=["job_id"])
        restarts = CounterMetricFamily("flightdeck_job_restarts", "restarts after faults", labels=["job_id"])
        budget = GaugeMetricFamily("flightdeck_job_max_restarts", "the spec's restart budget", labels=["job_id"])
        rollbacks = CounterMetricFamily("flightdeck_job_rollbacks", "rollbacks decided", labels=["job_id"])
        goodput = GaugeMetricFamily("flightdeck_job_goodput_ratio", "useful training / wall time, as postmortem "
                                    "computes it", labels=["job_id"])
        redone = GaugeMetricFamily("flightdeck_job_steps_redone", "steps computed again after its incidents, as "
                                   "postmortem counts them", labels=["job_id"])
        custom = GaugeMetricFamily("flightdeck_job_metric", "rank 0's newest value of a metric the script reports "
                                   "(report(..., name=value))", labels=["job_id", "name"])
        failing = GaugeMetricFamily("flightdeck_job_checkpoints_failing", "1 while the store refuses the job's "
                                    "checkpoints (CheckpointsFailing, until a commit)", labels=["job_id"])
        unsaved = GaugeMetricFamily("flightdeck_job_final_state_unsaved", "1 for a completed job whose final state "
                                    "is not in the store (FinalStateUnsaved)", labels=["job_id"])
        for job_id, j in jobs:
            v = j.view
            failing.add_metric([job_id], 1.0 if v.store_failing else 0.0)
            unsaved.add_metric([job_id], 1.0 if v.final_unsaved else 0.0)
            for p in PHASES:
                phase.add_metric([job_id, p], 1.0 if v.phase == p else 0.0)
            step.add_metric([job_id], float(v.steps_done or 0))
            planned.add_metric([job_id], float(v.steps))
            world.add_metric([job_id], float(v.world_size))
            steps.add_metric([job_id], float(j.steps))
            rate.add_metric([job_id], 1.0 / j.step_time_s if j.step_time_s > 0 else 0.0)
            tokens.add_metric([job_id], j.tokens)
            tps.add_metric([job_id], j.tokens_per_s)
            loss.add_metric([job_id], j.loss)
            restarts.add_metric([job_id], float(v.restarts))
            budget.add_metric([job_id], float(v.max_restarts))
            rollbacks.add_metric([job_id], float(v.rollbacks))
            for name, value in sorted(v.metrics.items()):
                custom.add_metric([job_id, name], value)
            if (a := covering(j)) is not None:
                goodput.add_metric([job_id], a.goodput)
                redone.add_metric([job_id], float(sum(r.steps_redone for r in a.rows)))
        yield from (phase, step, planned, world, steps, rate, tokens, tps, loss, restarts, budget, rollbacks, goodput,
                    redone, custom, failing, unsaved)
        yield histogram("flightdeck_checkpoint_stall_seconds", "rank 0's step loop blocked per checkpoint", ["job_id"],
                        CHECKPOINT_BUCKETS, (([k], j.stalls) for k, j in jobs))
        yield histogram("flightdeck_checkpoint_write_seconds", "rank 0's staging write per checkpoint", ["job_id"],
                        CHECKPOINT_BUCKETS, (([k], j.writes) for k, j in jobs))
        yield histogram("flightdeck_checkpoint_upload_seconds", "a node's shards of a checkpoint into the store",
                        ["job_id"], CHECKPOINT_BUCKETS, (([k], j.uploads) for k, j in jobs))
        yield histogram("flightdeck_checkpoint_commit_seconds", "the last rank's staging to the commit, stored",
                        ["job_id"], CHECKPOINT_BUCKETS,
                        (([k], a.commits) for k, j in jobs if (a := covering(j)) is not None))

    @staticmethod
    def _incidents(jobs: list[tuple[str, JobFigures]]) -> Iterator[Metric]:
        count = CounterMetricFamily("flightdeck_job_incidents", "incidents by kind, as postmortem finds them",
                                    labels=["job_id", "kind"])
        detect: dict[tuple[str, str], list[float]] = {}  # by (job, kind): a dashboard picks jobs, or sums them
        recover: dict[tuple[str, str], list[float]] = {}
        for job_id, j in jobs:
            if (a := covering(j)) is None:
                continue
            kinds: dict[str, int] = {}
            for row in a.rows:
                kind, ttd, ttr = row.kind, row.detect_s, row.recover_s
                kinds[kind] = kinds.get(kind, 0) + 1
                detect.setdefault((job_id, kind), []).append(ttd)
                if ttr is not None:
                    recover.setdefault((job_id, kind), []).append(ttr)
            for kind, n in sorted(kinds.items()):
                count.add_metric([job_id, kind], float(n))
        yield count
        yield histogram("flightdeck_incident_detect_seconds", "fault to finding", ["job_id", "kind"], DETECT_BUCKETS,
                        (([*k], v) for k, v in sorted(detect.items())))
        yield histogram("flightdeck_incident_recover_seconds", "fault to the first step after resuming",
                        ["job_id", "kind"], RECOVER_BUCKETS, (([*k], v) for k, v in sorted(recover.items())))

    @staticmethod
    def _services(f: Figures, live: Live) -> Iterator[Metric]:
        decisions = CounterMetricFamily("flightdeck_service_decisions", "events a service stored", labels=["service"])
        dead = CounterMetricFamily("flightdeck_service_dead_letters", "messages a service could not use",
                                   labels=["service"])
        lag = GaugeMetricFamily("flightdeck_service_consumer_lag_messages", "control messages a service has yet "
                                "to take", labels=["service"], unit="messages")
        for name in sorted({*subjects.SERVICES, *f.decisions, *f.dead_letters, *live.lag}):  # 0 until one decides
            decisions.add_metric([name], float(f.decisions.get(name, 0)))
            dead.add_metric([name], float(f.dead_letters.get(name, 0)))
            if name in live.lag:
                lag.add_metric([name], float(live.lag[name]))
        yield from (decisions, dead, lag)

    @staticmethod
    def _nodes(f: Figures) -> Iterator[Metric]:
        slots = GaugeMetricFamily("flightdeck_node_slots", "slots the node registered", labels=["node", "kind"])
        up = GaugeMetricFamily("flightdeck_node_up", "0 once found lost, until it registers again", labels=["node"])
        cordoned = GaugeMetricFamily("flightdeck_node_cordoned", "1 while no new ranks go there", labels=["node"])
        standbys = GaugeMetricFamily("flightdeck_node_standbys", "warm standby ranks ready, as its agent last said",
                                     labels=["node"])
        held = GaugeMetricFamily("flightdeck_node_snapshot_bytes",
                                 "bytes its ranks' snapshots hold in its memory (RAM), as its agent last said",
                                 labels=["node"])
        for name, n in sorted(f.nodes.items()):
            slots.add_metric([name, n.kind], float(n.slots))
            if n.standbys is not None:
                standbys.add_metric([name], float(n.standbys))
            if n.snapshot_held is not None:
                held.add_metric([name], float(n.snapshot_held))
            up.add_metric([name], 1.0 if n.up else 0.0)
            cordoned.add_metric([name], 1.0 if n.cordoned else 0.0)
        yield from (slots, up, cordoned, standbys, held)


def exposition(figures: Figures, live: Live, now: float | None = None) -> bytes:
    """The text a scrape of /metrics at `now` (default: the wall clock, which event times are in) gets."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FiguresCollector(figures, live, time.time() if now is None else now))
    return generate_latest(registry)
