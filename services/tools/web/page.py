"""What the dashboard page is pushed (`/events`, server-sent events): one JSON snapshot of the jobs, the fleet and,
when the page names one, a job's curves, incidents, checkpoints, decisions and output. Pure: built from `Figures`
and `Live`; sizes are bounded here (rows, points, text), whatever the event log holds, so the page stays quick at
any scale and a hostile string cannot swell it."""

import math
from typing import Any

from flightdeck.services.tools.history.jobview import ENDED
from flightdeck.services.tools.web.figures import Figures, JobFigures
from flightdeck.services.tools.web.metrics import Live

JOBS_SHOWN = 200  # the newest jobs listed
NODES_SHOWN = 1000
TEXT_MAX = 300  # characters of any one string shown (reasons, log lines, decisions)
METRICS_SHOWN = 64  # a job's custom metrics plotted, by name (a step carries at most codec.MAX_METRICS)


def text(value: str) -> str:
    return value if len(value) <= TEXT_MAX else value[:TEXT_MAX - 1] + "…"


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def job_row(j: JobFigures) -> dict[str, Any]:
    v = j.view
    rate = 1.0 / j.step_time_s if j.step_time_s > 0 else 0.0
    done = v.steps_done or 0
    eta = (v.steps - done) / rate if v.phase == "running" and rate > 0 and v.steps > done else None
    return {"id": v.job_id, "name": text(v.name), "phase": v.phase, "step": done, "steps": v.steps,
            "steps_per_s": finite(rate), "eta_s": eta, "world": v.world_size, "restarts": v.restarts,
            "max_restarts": v.max_restarts, "goodput": j.analysis.goodput if j.analysis else None,
            "loss": finite(j.loss), "reason": text(v.reason), "ended": v.phase in ENDED}


def job_detail(j: JobFigures) -> dict[str, Any]:
    v = j.view
    points = j.curve.shown()
    t0 = v.submitted_at
    return {
        **job_row(j),
        "curve": {"step": [p[0] for p in points], "loss": [finite(p[1]) for p in points],
                  "step_time": [finite(p[2]) for p in points],
                  "metrics": {name: [finite(x) if (x := p[3].get(name)) is not None else None for p in points]
                              for name in sorted(j.curve.names)[:METRICS_SHOWN]}},
        "incidents": [{"number": r.number, "kind": r.kind, "trigger": text(r.trigger), "attempt": r.attempt,
                       "fault_s": r.fault_s, "detect_s": r.detect_s, "recover_s": r.recover_s,
                       "decision": text(r.decision), "resolution": text(r.resolution),
                       "diagnosis": text(r.diagnosis), "steps_redone": r.steps_redone}
                      for r in (j.analysis.rows if j.analysis else ())],
        "checkpoints": [{"id": c.checkpoint_id, "step": c.step, "bytes": c.bytes,
                         "state": "bad" if c.bad else "deleted" if c.deleted else "kept",
                         "why": text(c.bad or c.deleted_reason)} for c in v.checkpoints[-50:]],
        "decisions": [{"at_s": at - t0 if t0 else None, "type": kind, "by": text(by), "text": text(what)}
                      for at, kind, by, what in list(j.decisions)[-100:]],
        "logs": [{"attempt": a, "rank": r, "text": text(line)} for a, r, line in j.logs],
    }


def snapshot(figures: Figures, live: Live, job_id: str | None, now: float) -> dict[str, Any]:
    jobs = list(figures.jobs.values())[-JOBS_SHOWN:][::-1]  # newest first
    fleet = [{"node": name, "kind": n.kind, "slots": n.slots, "free": n.free_slots, "standbys": n.standbys,
              "spare": n.spare, "up": n.up,
              "cordoned": n.cordoned, "seen_s_ago": max(now - n.seen_at, 0.0) if n.seen_at else None}
             for name, n in sorted(figures.nodes.items())[:NODES_SHOWN]]
    chosen = figures.jobs.get(job_id) if job_id else None
    return {"broker_up": live.broker_up, "jobs": [job_row(j) for j in jobs], "fleet": fleet,
            "job": job_detail(chosen) if chosen else None, "asked": job_id}
