"""A drill's incidents, one per injected fault: when it fired, when and how it was detected, what was decided
(a restart or a rollback with its skip window) and when training resumed; from the job's control history and
telemetry as `make demo` saw them. Times are relative to the submission; "+" is time since the fault."""

from collections.abc import Iterable
from dataclasses import dataclass

from flightdeck.events.base import Event
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import Finding, SpikeDiagnosed, StragglerDetected, diagnosis_summary
from flightdeck.events.job import AllocationRequested, JobCompleted, JobResumed, JobSubmitted, WorkersExited
from flightdeck.events.training import FaultInjected, RolledBack, StepCompleted

LABEL = 10


@dataclass(frozen=True)
class Mark:
    at: float  # seconds since submission
    text: str


@dataclass(frozen=True)
class Incident:
    fault: Mark
    detected: Mark | None  # the first sign the platform saw: a finding, or a rank's non-zero exit
    findings: tuple[str, ...]  # every finding of the fault's attempt that followed it, by type, in order
    decision: Mark | None
    resumed: Mark | None  # the first step trained after the recovery
    kind: str = ""  # the fault's kind
    action: str = ""  # "restart" or "rollback" once decided
    cause: str = ""  # a spike's diagnosis (SpikeDiagnosed), as the health monitor recorded it


def _after(events: list[Event], at: float) -> list[Event]:
    return [e for e in events if e.occurred_at >= at]


def incidents(seen: Iterable[Event]) -> tuple[float, list[Incident]]:
    """The submission time and the incidents of one job's events (any order: they are sorted by time)."""
    events = sorted(seen, key=lambda e: e.occurred_at)
    base = next((e.occurred_at for e in events if isinstance(e, JobSubmitted)), events[0].occurred_at if events else 0)
    faults = [e for e in events if isinstance(e, FaultInjected) and e.kind != "slow"]
    out: list[Incident] = []
    for n, fault in enumerate(faults):
        until = faults[n + 1].occurred_at if n + 1 < len(faults) else float("inf")
        later = [e for e in _after(events, fault.occurred_at) if e.occurred_at < until or not isinstance(e, Finding)]
        out.append(_incident(fault, later, base))
    return base, out


def _incident(fault: FaultInjected, later: list[Event], base: float) -> Incident:
    attempt = fault.attempt

    def mark(ev: Event, text: str) -> Mark:
        return Mark(ev.occurred_at - base, text)

    cause = next((diagnosis_summary(e).removeprefix("cause: ") for e in later
                  if isinstance(e, SpikeDiagnosed) and e.attempt == attempt), "")
    signs = [e for e in later if (isinstance(e, Finding) and not isinstance(e, StragglerDetected | SpikeDiagnosed)
                                  and e.attempt == attempt)
             or (isinstance(e, WorkersExited) and e.attempt == attempt and e.is_fault())]
    findings = tuple(type(e).__name__ for e in signs if isinstance(e, Finding))
    detected = None
    if signs:
        first = signs[0]
        text = (f"rank {first.rank} exited with code {first.exit_code}" if isinstance(first, WorkersExited)
                else f"{type(first).__name__} on rank {first.rank}" + _detail(first))
        detected = mark(first, text)
    decision, resumed, action = None, None, ""
    for e in later:
        if isinstance(e, RollbackRequested) and e.attempt == attempt:
            decision, action = mark(e, f"rollback to step {e.to_step} ({e.checkpoint_id}), "
                                       f"skip batches [{e.skip_from}, {e.skip_to})"), "rollback"
            landed = next((r for r in _after(later, e.occurred_at) if isinstance(r, RolledBack)
                           and r.attempt == attempt and r.checkpoint_id == e.checkpoint_id), None)
            if landed is not None:
                step = next((s for s in _after(later, landed.occurred_at) if isinstance(s, StepCompleted)
                             and s.attempt == attempt and s.step == landed.to_step), None)
                resumed = mark(step, f"step {step.step} trained again, in place (attempt {attempt})") if step else None
            break
        if isinstance(e, AllocationRequested) and e.attempt > attempt:
            decision, action = mark(e, f"restart as attempt {e.attempt} ({e.slots} slots)"), "restart"
            back = next((r for r in _after(later, e.occurred_at) if isinstance(r, JobResumed)
                         and r.attempt == e.attempt), None)
            step = next((s for s in _after(later, e.occurred_at) if isinstance(s, StepCompleted)
                         and s.attempt == e.attempt), None)
            if step is not None:
                source = f"from {back.checkpoint_id or 'scratch'}" if back is not None else ""
                resumed = mark(step, f"step {step.step} trained by attempt {e.attempt} {source}".rstrip())
            break
    where = f"rank {fault.rank}, step {fault.step}, attempt {attempt}"
    return Incident(fault=mark(fault, f"{fault.kind} injected ({where})"), detected=detected, findings=findings,
                    decision=decision, resumed=resumed, kind=fault.kind, action=action, cause=cause)


def _detail(ev: Finding) -> str:
    step = getattr(ev, "step", None)
    reason = getattr(ev, "reason", "")
    return f" at step {step}" if step is not None else f" ({reason})" if reason else ""


def render(seen: Iterable[Event]) -> list[str]:
    """The summary's lines."""
    events = list(seen)
    base, found = incidents(events)
    lines = ["incidents (times from submission; + is time since the fault):"]
    for n, inc in enumerate(found, 1):
        t0 = inc.fault.at
        lines.append(f"  {n}. {inc.fault.text} at {t0:.1f}s")
        for label, m in (("detected", inc.detected), ("decided", inc.decision), ("resumed", inc.resumed)):
            if m is None:
                lines.append(f"     {label:<{LABEL}} -")
            else:
                since = f"+{m.at - t0:.1f}s"
                lines.append(f"     {label:<{LABEL}} {m.at:>6.1f}s {since:>7}  {m.text}")
        if len(inc.findings) > 0:
            lines.append(f"     {'findings':<{LABEL}} {', '.join(dict.fromkeys(inc.findings))}")
        if inc.cause:
            lines.append(f"     {'cause':<{LABEL}} {inc.cause}")
    done = next((e for e in events if isinstance(e, JobCompleted)), None)
    if done is not None:
        lines.append(f"  completed {done.steps} steps at {done.occurred_at - base:.1f}s")
    return lines
