"""What the dashboard is pushed stays bounded and exact whatever the event log holds: a curve of any length is
thinned to a fixed size keeping its first and newest points, strings are cut, NaN is null, jobs are newest first."""

import itertools
import math
from pathlib import Path

import msgspec

from flightdeck.events.job import AllocationGranted, JobFailed, JobSubmitted, SlotRef, WorkersStarted
from flightdeck.events.spec import EntrypointSpec, JobSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.console.status import as_json, details
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.postmortem.analysis import analyse
from flightdeck.services.tools.web import page
from flightdeck.services.tools.web.figures import CURVE_POINTS, Curve, Figures
from flightdeck.services.tools.web.metrics import Live, exposition
from flightdeck.services.tools.web.server import job_analysis

ROOT = Path(__file__).resolve().parents[2]


def test_a_curve_of_any_length_keeps_a_bounded_evenly_thinned_set_and_its_newest_point() -> None:
    c = Curve()
    for step in range(100_003):
        c.add(step, 1.0 / (step + 1), 0.1)
    shown = c.shown()
    assert len(shown) <= 2 * CURVE_POINTS + 1
    assert shown[0][0] == 0 and shown[-1][0] == 100_002
    steps = [p[0] for p in shown[:-1]]
    assert len({b - a for a, b in itertools.pairwise(steps)}) == 1  # one stride: evenly spaced
    short = Curve()
    for step in range(10):
        short.add(step, 1.0, 0.1)
    assert [p[0] for p in short.shown()] == list(range(10))  # nothing thinned below the bound


def row(seq: int, event: JobSubmitted | JobFailed) -> Stored:
    event = msgspec.structs.replace(event, job_version=event.job_version or (2 if isinstance(event, JobFailed) else 1))
    return Stored(stream="FD_CONTROL", seq=seq, subject=f"fd.ctl.job.{event.job_id}.{type(event).__name__}",
                  data=b"", msg_id=event.event_id, event=event)


def test_strings_are_cut_nan_is_null_and_jobs_are_newest_first() -> None:
    f = Figures()
    for n in range(page.JOBS_SHOWN + 5):
        f.fold(row(n + 1, JobSubmitted(job_id=f"j-{n:06d}", event_id=f"s{n}", occurred_at=float(n),
                                        spec=JobSpec(name="x"))))
    f.fold(row(10_000, JobFailed(job_id="j-000000", event_id="f", occurred_at=1.0, reason="<b>" + "x" * 10_000)))
    snap = page.snapshot(f, Live(broker_up=False), "j-000000", now=2.0)
    assert len(snap["jobs"]) == page.JOBS_SHOWN and snap["jobs"][0]["id"] == f"j-{page.JOBS_SHOWN + 4:06d}"
    job = snap["job"]
    assert job["phase"] == "failed" and job["reason"].startswith("<b>xx") and len(job["reason"]) == page.TEXT_MAX
    assert job["loss"] is None and snap["broker_up"] is False  # no step yet: NaN goes out as null
    assert all(len(d["text"]) <= page.TEXT_MAX for d in job["decisions"])
    msgspec.json.encode(snap)  # JSON as it is pushed


def test_a_recorded_runs_page_shows_its_curve_decisions_and_fleet() -> None:
    f = Figures()
    for stored in fdh.load(ROOT / "tests" / "fixtures" / "histories" / "crash.fdh.jsonl"):
        f.fold(stored)
    snap = page.snapshot(f, Live(broker_up=True), "crash-000001", now=0.0)
    job = snap["job"]
    assert job["phase"] == "completed" and job["step"] == job["steps"] == 40
    steps = job["curve"]["step"]
    assert steps[-1] == 39 and all(math.isfinite(x) for x in job["curve"]["loss"])
    assert [d["type"] for d in job["decisions"]][:2] == ["JobSubmitted", "JobQueued"]
    assert [n["node"] for n in snap["fleet"]] == ["n1"] and snap["fleet"][0]["up"] is True


def test_a_spikes_incident_shows_its_diagnosis_as_the_postmortem_words_it() -> None:
    rows = fdh.load(ROOT / "tests" / "fixtures" / "histories" / "spike.fdh.jsonl")
    f = Figures()
    for stored in rows:
        f.fold(stored)
    pm = analyse(rows, "spike-000001")
    f.jobs["spike-000001"].analysis = job_analysis(pm, 0, 0)
    job = page.snapshot(f, Live(broker_up=True), "spike-000001", now=0.0)["job"]
    (incident,) = job["incidents"]
    assert incident["kind"] == "loss_spike" and incident["diagnosis"] == pm.incidents[0].diagnosis[:page.TEXT_MAX]
    assert incident["diagnosis"].startswith("cause: undetermined: the spike over steps 30-32")
    evidence = [e["type"] for e in incident["evidence"]]  # its causal chain, as the postmortem lists it
    assert evidence == [m.type for m in (*pm.incidents[0].chain, *pm.incidents[0].related)][:24]
    assert evidence[0] == "FaultInjected" and "LossSpikeDetected" in evidence and "RollbackRequested" in evidence
    assert "SpikeDiagnosed" in [d["type"] for d in job["decisions"]]


def test_a_script_s_own_metrics_are_shown_wherever_its_loss_is() -> None:
    """Recorded and never shown: the metrics a script reports (`report(step, loss, acc=...)`) reach the dashboard's
    curves, /metrics, `status` and its JSON, each under its own name, aligned with the steps that carried it."""
    f = Figures()
    f.fold(row(1, JobSubmitted(job_id="j-1", event_id="s", occurred_at=1.0, spec=JobSpec(name="x"))))
    for n, metrics in enumerate([{"acc": 0.5}, {}, {"acc": 0.75, "ppl": 12.5}]):
        f.fold(Stored(stream="FD_TELEMETRY", seq=n + 1, subject="fd.tel.j-1.0.StepCompleted", data=b"", msg_id="",
                      event=StepCompleted(job_id="j-1", rank=0, attempt=0, node="n", step=n, loss=1.0, grad_norm=0.0,
                                          lr=0.0, tokens_per_s=0.0, step_time_s=0.1, metrics=metrics,
                                          event_id=f"t{n}", occurred_at=2.0 + n)))
    curve = page.snapshot(f, Live(broker_up=True), "j-1", now=9.0)["job"]["curve"]
    assert curve["step"] == [0, 1, 2]
    assert curve["metrics"] == {"acc": [0.5, None, 0.75], "ppl": [None, None, 12.5]}
    scraped = exposition(f, Live(broker_up=True), now=9.0).decode()
    assert 'flightdeck_job_metric{job_id="j-1",name="acc"} 0.75' in scraped
    assert 'flightdeck_job_metric{job_id="j-1",name="ppl"} 12.5' in scraped
    view = f.jobs["j-1"].view
    assert "\nmetrics:    acc 0.75, ppl 12.5\n" in details(view, now=9.0)
    assert as_json(view, now=9.0)["metrics"] == {"acc": 0.75, "ppl": 12.5}


def test_a_job_s_page_shows_its_spec_layout_and_where_it_runs_and_compares_runs() -> None:
    """The job page: its spec as hyperparameter rows (environment values hidden), which rank runs on which node
    while it runs, and the fleet's view of the same grant; other runs' curves when the page compares them."""
    f = Figures()
    for stored in fdh.load(ROOT / "tests" / "fixtures" / "histories" / "crash.fdh.jsonl"):
        f.fold(stored)
    spec = JobSpec(name="x", slots=2, entrypoint=EntrypointSpec(command=["python", "t.py"], env={"HF_TOKEN": "s3cr3t"}))
    f.fold(row(10_001, JobSubmitted(job_id="j-1", event_id="s", occurred_at=1.0, spec=spec)))
    grant = AllocationGranted(job_id="j-1", event_id="g", occurred_at=2.0, attempt=0, job_version=2,
                              assignments=[SlotRef(node="n1", slot=1, rank=1), SlotRef(node="n1", slot=0, rank=0)])
    f.fold(Stored(stream="FD_CONTROL", seq=10_002, subject="fd.ctl.job.j-1.AllocationGranted", data=b"", msg_id="g",
                  event=grant))
    started = WorkersStarted(job_id="j-1", node="n1", attempt=0, ranks=[0, 1], pids=[1, 2], event_id="w",
                             occurred_at=3.0)
    f.fold(Stored(stream="FD_CONTROL", seq=10_003, subject="fd.ctl.job.j-1.node.n1.WorkersStarted", data=b"",
                  msg_id="w", event=started))
    snap = page.snapshot(f, Live(broker_up=True), "j-1", now=9.0, compare=("crash-000001", "nope"), actions=True)
    job = snap["job"]
    settings = dict(job["spec"])
    assert settings["slots"] == "2" and settings["train.lr"] == str(JobSpec(name="x").train.lr)
    assert settings["entrypoint.env.HF_TOKEN"] == "(set)" and "s3cr3t" not in msgspec.json.encode(snap).decode()
    assert job["layout"] == [{"rank": 0, "node": "n1", "slot": 0}, {"rank": 1, "node": "n1", "slot": 1}]
    (n1,) = snap["fleet"]
    assert (n1["used"], n1["jobs"]) == (2, [{"job": "j-1", "ranks": [0, 1]}])  # the ended crash job runs nowhere
    assert list(snap["compare"]) == ["crash-000001"] and snap["compare"]["crash-000001"]["curve"]["step"][-1] == 39
    assert snap["actions"] is True and "paused" in snap["phases"]
    assert job["age_s"] == 8.0 and job["submitted_at"] == 1.0
