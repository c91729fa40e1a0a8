"""The postmortem as report.md (PNGs beside it) and report.html (one self-contained file, PNGs inlined).

Both are rendered from one list of blocks (headings, paragraphs, tables, images), so they say the same.
"""

import base64
import datetime
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.postmortem.analysis import Postmortem
from flightdeck.services.tools.postmortem.describe import Mark
from flightdeck.services.tools.postmortem.goodput import BADPUT, PARTS
from flightdeck.services.tools.postmortem.plots import draw_all


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Table:
    head: tuple[str, ...]
    rows: Sequence[tuple[str, ...]]


@dataclass(frozen=True)
class Image:
    file: str
    alt: str


Block = Heading | Para | Table | Image

PART_MEANING = {
    "detection": "a fault until it was detected",
    "restart": "detected until new ranks were spawned (a rollback: until the ranks obeyed)",
    "restore": "rank start-up and checkpoint restore, until the first step after the fault",
    "checkpoint_stall": "the step loop blocked for checkpoint snapshots (slowest rank)",
    "redone": "computing steps that a rollback or restart threw away",
    "useful": "computing steps that stand in the final timeline",
    "startup": "an allocation granted until its first step",
    "queued": "waiting for slots",
    "shutdown": "after the last step until the job ended",
    "idle": "everything else: between steps, pauses",
}


def seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if abs(value) >= 3600:
        return f"{value / 3600:.2f} h"
    if abs(value) >= 120:
        return f"{value / 60:.1f} min"
    return f"{value:.2f} s"


def summary_lines(pm: Postmortem) -> list[tuple[str, str]]:
    s, g = pm.summary, pm.goodput
    started = datetime.datetime.fromtimestamp(s.started_at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    outcome = s.outcome + (f": {s.reason}" if s.reason else "")
    kinds: dict[str, int] = {}
    for i in pm.incidents:
        kinds[i.kind] = kinds.get(i.kind, 0) + 1
    worlds = " -> ".join(str(w) for w in s.world_sizes) or "-"
    return [
        ("job", s.job_id),
        ("outcome", outcome),
        ("submitted", started),
        ("wall time", seconds(s.wall_s)),
        ("steps", f"{s.steps_final} of {s.steps_planned} in the final timeline; {s.steps_computed} computed, "
                  f"{s.steps_computed - s.steps_final} thrown away"),
        ("goodput", f"{g.goodput:.1%} (useful training {seconds(g.parts['useful'])} of {seconds(s.wall_s)})"),
        ("incidents", f"{len(pm.incidents)}" + (" (" + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")"
                                                if kinds else "")),
        ("attempts", f"{s.attempts} (world sizes {worlds}), {s.rollbacks} rollback(s)"),
        ("history", f"{s.events} events of the job from {s.ranks} rank(s)"
                    + (f"; {s.undecodable} undecodable rows skipped" if s.undecodable else "")),
    ]


def _chain_rows(marks: list[Mark] | tuple[Mark, ...]) -> list[tuple[str, ...]]:
    return [(f"{m.at:.3f}" if not math.isnan(m.at) else "-", m.type, m.event_id or "-", m.detail) for m in marks]


def own_metrics(pm: Postmortem) -> list[tuple[str, ...]]:
    """Per custom metric rank 0 reported (`report(step, loss, name=value)`): how many reports carried it, its first
    and last value and its range (of its finite values), by name."""
    seen: dict[str, list[float]] = {}
    for ev in pm.scan.telemetry:
        if isinstance(ev, StepCompleted) and ev.rank == 0:
            for name, value in ev.metrics.items():
                seen.setdefault(name, []).append(value)
    rows: list[tuple[str, ...]] = []
    for name, v in sorted(seen.items()):
        fin = [x for x in v if math.isfinite(x)] or [math.nan]
        rows.append((name, str(len(v)), f"{v[0]:.4g}", f"{v[-1]:.4g}", f"{min(fin):.4g}", f"{max(fin):.4g}"))
    return rows


def blocks(pm: Postmortem) -> list[Block]:
    s, g = pm.summary, pm.goodput
    out: list[Block] = [Heading(1, f"Postmortem: {s.job_id}"),
                        Table(("", ""), [(k, v) for k, v in summary_lines(pm)])]
    if pm.causes:
        out += [Heading(2, "Why it failed"), Para(s.reason),
                Table(("t (s)", "cause", "id", "what"), _chain_rows(pm.causes))]
    out += [Heading(2, "Plots"), Image("loss.png", "loss curve"), Image("step_rate.png", "step rate"),
            Image("time.png", "where the wall time went")]
    if own := own_metrics(pm):
        out += [Heading(2, "The script's own metrics (rank 0)"),
                Table(("metric", "reports", "first", "last", "min", "max"), own)]
    out.append(Heading(2, "Incidents"))
    if not pm.incidents:
        out.append(Para("None: no fault was injected or reported, and no finding was made."))
    else:
        out.append(Table(("#", "trigger", "decision", "time to detect", "time to recover", "steps lost",
                          "steps redone", "resolution"),
                         [(str(i.number), i.trigger, f"{i.decision}: {i.decision_detail}", seconds(i.time_to_detect),
                           seconds(i.time_to_recover), str(i.steps_lost), str(i.steps_redone), i.resolution)
                          for i in pm.incidents]))
        out.append(Para("Time to detect: fault to the finding (or exit) the platform acted on. Time to recover: "
                        "fault to the end of the first step after resuming. Times in the chains are seconds "
                        "from submission."))
        for i in pm.incidents:
            out.append(Heading(3, f"Incident {i.number}: {i.kind} (attempt {i.attempt})"))
            if i.diagnosis:
                out.append(Para(i.diagnosis[:1].upper() + i.diagnosis[1:]))
            out.append(Table(("t (s)", "event", "id", "what"), _chain_rows(i.chain)))
            if i.related:
                out += [Para("Also reported:"), Table(("t (s)", "event", "id", "what"), _chain_rows(i.related))]
    if pm.observations:
        out += [Heading(2, "Observations"),
                Para("Seen and, by design, not acted on: a lone loss far above its baseline whose next losses were "
                     "back in line (one bad batch needs no rollback); look at the batch each step read."),
                Table(("t (s)", "event", "id", "what"), _chain_rows(pm.observations))]
    out += [Heading(2, "Goodput and badput"),
            Para(f"Goodput {g.goodput:.1%}: useful training time over wall time. Every instant of the wall time "
                 "is counted once, in the first part that covers it, in this order:"),
            Table(("part", "seconds", "share", "what"),
                  [(p, f"{g.parts[p]:.3f}", f"{g.parts[p] / g.wall_s:.1%}" if g.wall_s else "-", PART_MEANING[p])
                   for p in PARTS]
                  + [("badput", f"{sum(g.parts[p] for p in BADPUT):.3f}",
                      f"{sum(g.parts[p] for p in BADPUT) / g.wall_s:.1%}" if g.wall_s else "-", "all but useful"),
                     ("wall", f"{g.wall_s:.3f}", "100%", "submission to the job's end")])]
    out.append(Heading(2, "Timeline"))
    if pm.timeline_left_out:
        out.append(Para(f"{pm.timeline_left_out} checkpoint commits and deletions (and later events past "
                        "the first rows) are left out of this table; `flightdeck events` lists them all."))
    out.append(Table(("t (s)", "event", "what"), [(f"{m.at:.3f}", m.type, m.detail) for m in pm.timeline]))
    return out


def _md(text: str) -> str:
    """`text` as Markdown shows it literally: a job's name, a reason or a rank's output is the job's to choose, and raw
    HTML in it would be rendered (or run) by whatever displays report.md."""
    return html.escape(text, quote=False)


def _cell(text: str) -> str:
    return _md(text).replace("|", "\\|").replace("\n", " ")


def markdown(items: list[Block]) -> str:
    lines: list[str] = []
    for b in items:
        match b:
            case Heading():
                lines += ["#" * b.level + " " + _md(b.text), ""]
            case Para():
                lines += [_md(b.text), ""]
            case Table():
                lines.append("| " + " | ".join(_cell(h) for h in b.head) + " |")
                lines.append("|" + "---|" * len(b.head))
                lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in b.rows]
                lines.append("")
            case Image():
                lines += [f"![{_cell(b.alt)}]({b.file})", ""]
    return "\n".join(lines)


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}"
         "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}"
         "th{background:#f3f3f3}img{max-width:100%;display:block;margin:1em 0}")


def html_page(items: list[Block], images: dict[str, bytes], title: str) -> str:
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body>"]
    for b in items:
        match b:
            case Heading():
                parts.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
            case Para():
                parts.append(f"<p>{html.escape(b.text)}</p>")
            case Table():
                head = "".join(f"<th>{html.escape(h)}</th>" for h in b.head) if any(b.head) else ""
                body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in b.rows)
                parts.append(f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>")
            case Image():
                data = base64.b64encode(images[b.file]).decode("ascii")
                parts.append(f"<img alt='{html.escape(b.alt)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_report(pm: Postmortem, out: Path) -> dict[str, Path]:
    """Write report.md, report.html and the PNGs into `out` (created if missing); returns them by name."""
    out.mkdir(parents=True, exist_ok=True)
    pngs = draw_all(pm, out)
    items = blocks(pm)
    md = out / "report.md"
    md.write_text(markdown(items), encoding="utf-8")
    page = out / "report.html"
    page.write_text(html_page(items, {p.name: p.read_bytes() for p in pngs}, f"Postmortem: {pm.summary.job_id}"),
                    encoding="utf-8")
    return {"report.md": md, "report.html": page, **{p.name: p for p in pngs}}
