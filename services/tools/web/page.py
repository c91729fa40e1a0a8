"""What the dashboard page is pushed (`/events`, server-sent events): one JSON snapshot of the jobs, the fleet and,
when the page names one, a job's curves, incidents, checkpoints, decisions and output. Pure: built from `Figures`
and `Live`; sizes are bounded here (rows, points, text), whatever the event log holds, so the page stays quick at
any scale and a hostile string cannot swell it."""

import math
from typing import Any

import msgspec

from flightdeck.events.plan import bubble, coordinates, described
from flightdeck.services.tools.history.jobview import ENDED, PHASES
from flightdeck.services.tools.web.figures import Figures, JobFigures
from flightdeck.services.tools.web.metrics import Live

JOBS_SHOWN = 200  # the newest jobs listed
NODES_SHOWN = 1000
TEXT_MAX = 300  # characters of any one string shown (reasons, log lines, decisions)
METRICS_SHOWN = 64  # a job's custom metrics plotted, by name (a step carries at most codec.MAX_METRICS)
SPEC_ROWS = 200  # a spec's hyperparameter rows shown
COMPARED = 4  # jobs whose curves one page overlays
HIDDEN = "entrypoint.env."  # a job's environment variables may hold tokens: the page says only that they are set


def text(value: str) -> str:
    return value if len(value) <= TEXT_MAX else value[:TEXT_MAX - 1] + "…"


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def job_row(j: JobFigures, now: float) -> dict[str, Any]:
    v = j.view
    rate = 1.0 / j.step_time_s if j.step_time_s > 0 else 0.0
    done = v.steps_done or 0
    eta = (v.steps - done) / rate if v.phase == "running" and rate > 0 and v.steps > done else None
    return {"id": v.job_id, "name": text(v.name), "phase": v.phase, "step": done, "steps": v.steps,
            "steps_per_s": finite(rate), "eta_s": eta, "world": v.world_size, "restarts": v.restarts,
            "max_restarts": v.max_restarts, "goodput": j.analysis.goodput if j.analysis else None,
            "loss": finite(j.loss), "reason": text(v.reason), "ended": v.phase in ENDED,
            "submitted_at": v.submitted_at or None, "age_s": max(now - v.submitted_at, 0.0) if v.submitted_at else None,
            "paused": text(v.paused), "store_failing": text(v.store_failing), "final_unsaved": text(v.final_unsaved)}


def curve(j: JobFigures) -> dict[str, Any]:
    """Rank 0's curves as the page plots them: steps, loss, step time and each custom metric, aligned."""
    points = j.curve.shown()
    return {"step": [p[0] for p in points], "loss": [finite(p[1]) for p in points],
            "step_time": [finite(p[2]) for p in points],
            "metrics": {name: [finite(x) if (x := p[3].get(name)) is not None else None for p in points]
                        for name in sorted(j.curve.names)[:METRICS_SHOWN]}}


def flat(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A spec as (dotted key, value) rows, as a person reads hyperparameters: train.lr 0.0003."""
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in flat(v, f"{prefix}{k}.")]
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return [row for i, x in enumerate(value) for row in flat(x, f"{prefix}{i}.")]
    return [] if value is None else [(prefix.rstrip("."), text(str(value)))]  # None: a setting not given


def job_detail(j: JobFigures, now: float) -> dict[str, Any]:
    v = j.view
    t0 = v.submitted_at
    plan = j.plan
    return {
        **job_row(j, now),
        "curve": curve(j),
        "spec": [(k, "(set)" if k.startswith(HIDDEN) else x) for k, x in flat(msgspec.to_builtins(j.spec))][:SPEC_ROWS]
        if j.spec is not None else [],
        "layout": [{"rank": r.rank, "node": r.node, "slot": r.slot,
                    **(coordinates(plan, r.rank) if plan and plan.world_size == len(j.placed) else {})}
                   for r in j.placed[:NODES_SHOWN]],
        "plan": None if plan is None else {"world_size": plan.world_size, "dp": plan.dp, "tp": plan.tp, "pp": plan.pp,
                                           "micro_batches": plan.micro_batches, "bubble": bubble(plan),
                                           "memory_per_gpu_gb": finite(plan.memory_per_gpu_gb),
                                           "described": described(plan)},
        "incidents": [{"number": r.number, "kind": r.kind, "trigger": text(r.trigger), "attempt": r.attempt,
                       "fault_s": r.fault_s, "detect_s": r.detect_s, "recover_s": r.recover_s,
                       "decision": text(r.decision), "resolution": text(r.resolution),
                       "diagnosis": text(r.diagnosis), "steps_redone": r.steps_redone,
                       "evidence": [{"at_s": at, "type": kind, "what": text(what)} for at, kind, what in r.evidence]}
                      for r in (j.analysis.rows if j.analysis else ())],
        "checkpoints": [{"id": c.checkpoint_id, "step": c.step, "bytes": c.bytes,
                         "state": "bad" if c.bad else "deleted" if c.deleted else "kept",
                         "why": text(c.bad or c.deleted_reason)} for c in v.checkpoints[-50:]],
        "decisions": [{"at_s": at - t0 if t0 else None, "type": kind, "by": text(by), "text": text(what)}
                      for at, kind, by, what in list(j.decisions)[-100:]],
        "logs": [{"attempt": a, "rank": r, "text": text(line)} for a, r, line in j.logs],
    }


def running_where(figures: Figures) -> dict[str, list[tuple[str, list[int]]]]:
    """Per node, the jobs whose ranks run there now and which ranks, from their grants."""
    where: dict[str, dict[str, list[int]]] = {}
    for job_id, j in figures.jobs.items():
        for ref in j.placed:
            where.setdefault(ref.node, {}).setdefault(job_id, []).append(ref.rank)
    return {node: sorted(jobs.items()) for node, jobs in where.items()}


def snapshot(figures: Figures, live: Live, job_id: str | None, now: float, *, compare: tuple[str, ...] = (),
             actions: bool = False) -> dict[str, Any]:
    """What a page is pushed: the job list, the fleet and, when it names them, one job's page and the curves of the
    jobs it compares (`compare`, at most COMPARED). `actions`: the server takes operator actions (it has a token)."""
    jobs = list(figures.jobs.values())[-JOBS_SHOWN:][::-1]  # newest first
    where = running_where(figures)
    fleet = [{"node": name, "kind": n.kind, "slots": n.slots, "free": n.free_slots, "standbys": n.standbys,
              "snapshot_bytes": n.snapshot_held, "spare": n.spare, "up": n.up,
              "cordoned": n.cordoned, "seen_s_ago": max(now - n.seen_at, 0.0) if n.seen_at else None,
              "used": sum(len(ranks) for _, ranks in where.get(name, [])),
              "jobs": [{"job": job, "ranks": ranks} for job, ranks in where.get(name, [])]}
             for name, n in sorted(figures.nodes.items())[:NODES_SHOWN]]
    chosen = figures.jobs.get(job_id) if job_id else None
    compared = {k: {"name": text(j.view.name), "curve": curve(j)} for k in compare[:COMPARED]
                if (j := figures.jobs.get(k)) is not None}
    return {"broker_up": live.broker_up, "jobs": [job_row(j, now) for j in jobs], "fleet": fleet,
            "job": job_detail(chosen, now) if chosen else None, "asked": job_id, "compare": compared,
            "actions": actions, "phases": list(PHASES)}
