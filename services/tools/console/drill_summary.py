"""The demo's incident summary: the job's incidents as `flightdeck postmortem` finds them (postmortem/incidents.py,
the one place incidents are derived), each as its fault, when and how it was detected, what was decided, when
training resumed and the steps it cost. Times are from the job's submission; "+" is time since the fault."""

from flightdeck.events.findings import Finding, SpikeDiagnosed
from flightdeck.services.tools.postmortem import Postmortem
from flightdeck.services.tools.postmortem.describe import Mark
from flightdeck.services.tools.postmortem.incidents import Incident

LABEL = 10
# the event a decision is recorded as, by the incident's decision
DECIDED_BY = ("RollbackRequested", "AllocationRequested", "JobFailed", "PauseRequested", "AllocationReleased")
NOT_SIGNS = ("FaultInjected", "StepCompleted", "RankStarted")  # the fault itself and training: not its detection
# what the platform heard of a fault: its findings, and the exits and faults ranks and agents recorded
REPORTS = frozenset({*(c.__name__ for c in Finding.__subclasses__() if c is not SpikeDiagnosed), "WorkersExited",
                     "RankFault"})


def _line(label: str, at: float, since: float, text: str) -> str:
    return f"     {label:<{LABEL}} {at:>6.1f}s {f'+{at - since:.1f}s':>7}  {text}"


def _first(marks: tuple[Mark, ...], types: tuple[str, ...], *, at_least: float) -> Mark | None:
    return next((m for m in marks if m.type in types and m.at >= at_least), None)


def incident_lines(n: int, i: Incident) -> list[str]:
    fault = i.trigger.split(" -> ", 1)[0]
    lines = [f"  {n}. {i.kind}: {fault} (attempt {i.attempt}) at {i.fault_at:.1f}s"]
    sign = next((m for m in i.chain if m.at >= i.detected_at and m.type not in NOT_SIGNS), None)
    lines.append(_line("detected", i.detected_at, i.fault_at, f"{sign.type}: {sign.detail}" if sign else i.trigger))
    decided = _first(i.chain, DECIDED_BY, at_least=i.detected_at)
    if i.decision != "none":
        at = decided.at if decided is not None else i.detected_at
        lines.append(_line("decided", at, i.fault_at, f"{i.decision}: {i.decision_detail}"))
    if i.recovered_at is not None:
        lines.append(_line("resumed", i.recovered_at, i.fault_at, i.resolution))
    else:
        lines.append(f"     {'resumed':<{LABEL}} -  {i.resolution}")
    reports = dict.fromkeys(m.type for m in (*i.chain, *i.related) if m.type in REPORTS)
    if reports:
        lines.append(f"     {'reports':<{LABEL}} {', '.join(reports)}")
    lines.append(f"     {'cost':<{LABEL}} {i.steps_lost} steps lost, {i.steps_redone} redone")
    if i.diagnosis:
        lines.append(f"     {'cause':<{LABEL}} {i.diagnosis.removeprefix('cause: ')}")
    return lines


def render(pm: Postmortem) -> list[str]:
    """The summary's lines."""
    lines = ["incidents (times from submission; + is time since the fault):"]
    for n, i in enumerate(pm.incidents, 1):
        lines += incident_lines(n, i)
    if not pm.incidents:
        lines.append("  none")
    s = pm.summary
    lines.append(f"  {s.outcome} {s.steps_final} steps" + (f" ({s.reason})" if s.reason else "")
                 + f"; goodput {pm.goodput.goodput:.1%}")
    return lines
