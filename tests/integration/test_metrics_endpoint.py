"""`/metrics` on a broker holding a real recorded run (the crash drill's history, stored as it was): every figure
equals what the history says — postmortem's incidents, detect and recover times and goodput, the job view's
restarts, each service's decisions and dead letters, the node's slots — and a broker outage shows as such, then
heals without counting anything twice."""

import asyncio
import json
import math
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from flightdeck.events import subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged
from flightdeck.events.clock import ClockTick, DeadLettered
from flightdeck.events.fleet import NodeHeartbeat, NodeRegistered
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobSubmitted
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.history import fdh, jobview
from flightdeck.services.tools.postmortem import analyse
from flightdeck.services.tools.web.figures import Figures, IncidentRow, JobAnalysis
from flightdeck.services.tools.web.metrics import ENDED_SERIES_S, Live, exposition
from flightdeck.services.tools.web.server import serve
from tests.conftest import ensure_streams_at

ROOT = Path(__file__).resolve().parents[2]
CRASH = ROOT / "tests" / "fixtures" / "histories" / "crash.fdh.jsonl"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Ui:
    url: str
    broker: broker_mod.Broker
    rows: list[Stored]
    job_id: str


async def scrape(url: str) -> tuple[int, Samples]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as answer:
        text = await answer.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return answer.status, samples


async def healthz(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(url + "/healthz") as answer:
        return answer.status


async def until(what: str, check, within: float = 90.0):  # type: ignore[no-untyped-def]
    for _ in range(int(within / 0.1)):
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
async def ui(tmp_path: Path) -> AsyncIterator[Ui]:
    broker = broker_mod.start(tmp_path / "nats")
    await asyncio.to_thread(ensure_streams_at, broker.url)
    rows = fdh.load(CRASH)
    store = await JetStreamStore.connect(broker.url)
    try:
        for row in rows:  # in file order, on a fresh broker: the same sequences as when it was recorded
            await store.append_bytes(row.subject, row.data, msg_id=row.msg_id)
        await store.append(subjects.dead("scheduler"), DeadLettered(
            service="scheduler", stream=subjects.CONTROL, seq=1, subject="fd.ctl.job.x.Junk", reason="undecodable",
            payload=b"\x00", event_id="dead-1", occurred_at=1.0, producer="scheduler"))
    finally:
        await store.close()
    job_id = next(r.event.job_id for r in rows if isinstance(r.event, JobSubmitted))
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    ended = max(r.event.occurred_at for r in rows if r.event is not None)  # the recorded job's series still shown
    task = asyncio.create_task(serve(broker.url, "127.0.0.1", 0, stop, ready=ready, clock=lambda: ended))
    ui = Ui("", broker, rows, job_id)
    try:
        ui.url = f"http://127.0.0.1:{await asyncio.wait_for(ready, 60)}"
        yield ui
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        ui.broker.stop()  # the one running now: a test may have restarted it


def analysed(samples: Samples, job_id: str) -> bool:
    return (("flightdeck_job_goodput_ratio", (("job_id", job_id),)) in samples
            and samples.get(("flightdeck_service_decisions_total", (("service", "scheduler"),)), 0) > 0)


async def test_every_figure_is_what_the_recorded_history_says(ui: Ui) -> None:
    job = ui.job_id

    async def ready() -> Samples | None:
        status, samples = await scrape(ui.url)
        return samples if status == 200 and analysed(samples, job) else None

    got = await until("the job's analysis", ready)
    pm = analyse(ui.rows, job)
    assert pm.incidents, "the crash drill's history has an incident"

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert value("flightdeck_job_goodput_ratio", job_id=job) == pytest.approx(pm.goodput.goodput, abs=1e-12)
    assert value("flightdeck_job_steps_redone", job_id=job) == sum(i.steps_redone for i in pm.incidents)
    kinds = {i.kind for i in pm.incidents}
    for kind in kinds:
        mine = [i for i in pm.incidents if i.kind == kind]
        assert value("flightdeck_job_incidents_total", job_id=job, kind=kind) == len(mine)
        assert value("flightdeck_incident_detect_seconds_count", job_id=job, kind=kind) == len(mine)
        assert value("flightdeck_incident_detect_seconds_sum", job_id=job, kind=kind) == pytest.approx(
            sum(i.time_to_detect for i in mine))
        recovered = [i.time_to_recover for i in mine if i.time_to_recover is not None]
        assert value("flightdeck_incident_recover_seconds_sum", job_id=job, kind=kind) == pytest.approx(sum(recovered))

    # Commit times: the last rank's staging to the commit, dated as postmortem dates control events.
    staged: dict[tuple[int, int, int], float] = {}
    for r in ui.rows:
        if isinstance(r.event, CheckpointStaged):
            key = (r.event.attempt, r.event.step, r.event.timeline)
            staged[key] = max(staged.get(key, 0.0), r.event.occurred_at)
    tick, commits = 0.0, []
    for r in ui.rows:  # the control stream in order: a commit is stored after every tick before it
        match r.event:
            case ClockTick(now=now):
                tick = max(tick, now)
            case CheckpointCommitted(attempt=a, step=s, timeline=t, occurred_at=at) if (a, s, t) in staged:
                commits.append(max(at, tick) - staged[(a, s, t)])  # (the fixture keeps the newest telemetry only)
    assert len(commits) >= 3
    assert value("flightdeck_checkpoint_commit_seconds_count", job_id=job) == len(commits)
    assert value("flightdeck_checkpoint_commit_seconds_sum", job_id=job) == pytest.approx(sum(commits))

    control = [r.event for r in ui.rows if r.stream == subjects.CONTROL and r.event is not None]
    view = jobview.fold(job, [e for e in control if isinstance(e, JobEvent) and e.job_id == job])
    assert value("flightdeck_job_restarts_total", job_id=job) == view.restarts >= 1
    assert value("flightdeck_job_phase", job_id=job, phase=view.phase) == 1.0
    assert sum(v for (name, labels), v in got.items() if name == "flightdeck_job_phase") == 1.0  # one phase
    lead = [r.event for r in ui.rows if isinstance(r.event, StepCompleted) and r.event.rank == 0]
    assert value("flightdeck_job_steps_total", job_id=job) == len(lead)
    assert math.isclose(value("flightdeck_job_loss", job_id=job), lead[-1].loss)
    for service in subjects.SERVICES:
        authored = sum(1 for r in ui.rows if r.stream == subjects.CONTROL and r.event is not None
                       and r.event.producer == service and not r.subject.startswith("fd.ctl.clock."))
        assert value("flightdeck_service_decisions_total", service=service) == authored, service
    assert value("flightdeck_service_dead_letters_total", service="scheduler") == 1
    (node,) = {e.node: e for e in control if isinstance(e, NodeRegistered)}.values()
    assert value("flightdeck_node_slots", node=node.node, kind=node.kind) == node.slots
    assert value("flightdeck_node_up", node=node.node) == 1.0
    said = [e for e in control if isinstance(e, NodeHeartbeat) and e.node == node.node]
    if said and said[-1].snapshot_held >= 0:  # what its ranks' snapshots hold in its memory, as its agent last said
        assert value("flightdeck_node_snapshot_bytes", node=node.node) == said[-1].snapshot_held
    assert value("flightdeck_broker_up") == 1.0 and await healthz(ui.url) == 200

    # The dashboard's push for the job: the same incidents, at postmortem's times.
    async with aiohttp.ClientSession() as http, http.get(f"{ui.url}/events?job={job}") as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"
        async for line in stream.content:
            if line.startswith(b"data: "):
                board = json.loads(line[len(b"data: "):])
                break
    assert [(i["kind"], i["fault_s"], i["detect_s"]) for i in board["job"]["incidents"]] == [
        (i.kind, i.fault_at, i.time_to_detect) for i in pm.incidents]
    assert board["job"]["phase"] == view.phase and board["broker_up"] is True

    # The broker goes away: the page says so; it comes back: the figures are the same, nothing counted twice.
    ui.broker.stop()
    await until("the outage to show", lambda: _broker_up_is(ui.url, 0.0))
    assert await healthz(ui.url) == 503
    ui.broker = await asyncio.to_thread(ui.broker.restart)
    await until("the broker to be back", lambda: _broker_up_is(ui.url, 1.0))
    _, after = await scrape(ui.url)
    for key in [k for k in got if k[0] != "flightdeck_service_consumer_lag_messages"]:
        assert after[key] == got[key] or (math.isnan(after[key]) and math.isnan(got[key])), key


async def _broker_up_is(url: str, want: float) -> bool:
    _, samples = await scrape(url)
    return samples.get(("flightdeck_broker_up", ()), -1.0) == want


def test_the_cli_refuses_a_bad_port_and_an_unreachable_broker(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "flightdeck.services.tools.console", "ui"]
    bad = subprocess.run([*cli, "--port", "70000"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--port 70000: choose 0-65535" in bad.stderr
    gone = subprocess.run([*cli, "--nats", "nats://127.0.0.1:9", "--port", "0"], capture_output=True, text=True,
                          timeout=60)
    assert gone.returncode != 0 and "cannot reach the broker at nats://127.0.0.1:9" in gone.stderr, gone.stderr


def test_the_shipped_alerts_and_dashboard_use_only_exported_metrics() -> None:
    figures = Figures()
    for row in fdh.load(CRASH):
        figures.fold(row)
    for n in figures.nodes.values():  # as an agent with a standby pool reports it
        n.free_slots, n.standbys = 0, 2
    for j in figures.jobs.values():  # as the server sets it: every family then has samples
        j.analysis = JobAnalysis(rows=(IncidentRow(number=1, kind="crash", trigger="", attempt=0, fault_s=0.0,
                                                   detect_s=1.0, recover_s=5.0, decision="", resolution=""),),
                                 goodput=0.5, parts={}, control_seq=j.control_seq,
                                 telemetry_seq=j.telemetry_seq)  # of its whole history
    ended = max(j.view.ended_at for j in figures.jobs.values())
    text = exposition(figures, Live(broker_up=True, lag={"scheduler": 0}), now=ended).decode()
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    rules = yaml.safe_load((ROOT / "infra" / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    dashboard = json.loads((ROOT / "infra" / "grafana" / "flightdeck.json").read_text())
    exprs = {r["alert"]: r["expr"] for r in rules}
    exprs |= {f"{p['title']} {t['refId']}": t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    assert {"FlightdeckJobFailed", "FlightdeckRestartBudgetNearlySpent", "FlightdeckGoodputLow",
            "FlightdeckConsumerLag"} <= exprs.keys()
    for where, expr in exprs.items():
        names = set(re.findall(r"flightdeck_[a-z_]+", expr))
        assert names and names <= exported, (where, names - exported)
        assert re.search(r"\bjob\s*[=!~]", expr) is None, where  # `job` is Prometheus' scrape label: ours is job_id
        if not where.startswith("Flightdeck"):  # a dashboard panel: a job's figures follow the $job picker
            for name, selector in re.findall(r"(flightdeck_(?:job|incident|checkpoint)_[a-z_]+)(\{[^}]*\})?", expr):
                assert 'job_id=~"$job"' in selector, (where, name, "ignores the $job picker")


def test_an_ended_job_s_series_expire_an_hour_after_its_end_so_its_alerts_resolve() -> None:
    figures = Figures()
    for row in fdh.load(CRASH):
        figures.fold(row)
    (job,) = figures.jobs.values()
    assert job.view.ended

    def series(now: float) -> set[str]:
        text = exposition(figures, Live(broker_up=True), now=now).decode()
        return {s.name for family in text_string_to_metric_families(text) for s in family.samples
                if s.labels.get("job_id") == job.view.job_id}

    assert "flightdeck_job_phase" in series(job.view.ended_at + ENDED_SERIES_S)
    assert series(job.view.ended_at + ENDED_SERIES_S + 1) == set()
    assert figures.jobs  # the dashboard still lists it
