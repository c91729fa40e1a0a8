"""`flightdeck whatif JOB --set KEY=VALUE ...`: the job's recorded inputs through every core with its policy
changed; which decisions vanish, appear or differ, and a first-order estimate of the goodput
(services/tools/audit/whatif.py)."""

import argparse
import asyncio
import collections
import sys
from typing import Any

import msgspec

from flightdeck.events import codec
from flightdeck.services.tools.audit import settings
from flightdeck.services.tools.audit.simulate import Change
from flightdeck.services.tools.audit.whatif import WhatIf, whatif
from flightdeck.services.tools.cli import Command, UserError
from flightdeck.services.tools.console.output import relative
from flightdeck.services.tools.history import add_history_arguments, history_from_args

EXIT_BAD_SETTING = 2
_ENVELOPE = {"type", "event_id", "occurred_at", "causation_id", "producer", "schema_version", "job_id", "job_version"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_history_arguments(parser)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a policy setting to change, e.g. policy.spike_z=8 (repeatable; "
                        "policy.<field> or train.checkpoint_every)")
    parser.add_argument("--json", action="store_true", help="the what-if as one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        wanted = settings.parse(args.sets)
    except settings.BadSetting as exc:
        raise UserError(str(exc), EXIT_BAD_SETTING) from None
    result, source = asyncio.run(_whatif(args, wanted))
    out = codec.to_json(as_json(result, source)).decode() if args.json else "\n".join(report(result, source))
    sys.stdout.write(out + "\n")
    return 0


async def _whatif(args: argparse.Namespace, wanted: dict[str, Any]) -> tuple[WhatIf, str]:
    history = await history_from_args(args)
    try:
        return whatif(history.rows, history.job_id, wanted), history.source
    except settings.BadSetting as exc:
        raise UserError(str(exc), EXIT_BAD_SETTING) from None
    except LookupError as exc:
        raise UserError(f"{history.source}: {exc}") from None


def report(w: WhatIf, source: str) -> list[str]:
    m = w.measured
    asked = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in w.settings.items()) or "the recorded settings"
    lines = [f"whatif {w.job_id} ({source}): {asked}", ""]
    restated = (f", {len(w.outcome.restated)} of them restating the changed setting in their words "
                f"({', '.join(sorted({f for c in w.outcome.restated for f, _, _ in c.fields()}))})"
                if w.outcome.restated else "")
    if not w.changes:
        lines.append(f"no decision changes: all {w.outcome.kept + len(w.outcome.restated)} decisions about the job "
                     f"are made as recorded{restated}")
    else:
        lines.append(f"decisions that change ({len(w.changes)}; {w.outcome.kept + len(w.outcome.restated)} made as "
                     f"recorded{restated}), in time order:")
        first = w.changes[0].position[0]
        for c in w.changes:
            lines.append(_change(c, m.start, counterfactual=c.position[0] > first))
            lines += [f"      {f}: {_short(a)} -> {_short(b)}" for f, a, b in c.fields()]
    if w.outcome.dropped:
        kinds = collections.Counter(type(s.event).__name__ for s in w.outcome.dropped)
        lines.append(f"recorded inputs that follow from a gone decision and are left out: {len(w.outcome.dropped)} ("
                     + ", ".join(f"{n} x{k}" for n, k in kinds.most_common()) + ")")
    lines += ["", "goodput (useful training time / wall time), first-order estimate:",
              f"  recorded: {m.outcome}, wall {m.wall_s:.1f} s, useful {m.useful_s:.1f} s ({m.done} steps, median "
              f"{m.step_s * 1000:.0f} ms), goodput {m.goodput():.3f} (as the postmortem splits it)",
              f"  what-if:  {w.ends}, wall {w.wall_s:.1f} s, useful {w.useful_s:.1f} s, goodput {w.goodput:.3f}"]
    lines += [f"    {e.seconds:+8.1f} s  {e.what}" + (f": {e.note}" if e.note else "") for e in w.estimates]
    lines += ["", "what a what-if can and cannot know:", *(f"  - {c}" for c in w.caveats)]
    return lines


def _change(c: Change, start: float, *, counterfactual: bool) -> str:
    ev = c.event
    fields = codec.to_builtins(ev)
    text = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if k not in _ENVELOPE and v not in ("", [], {}))
    trigger = c.trigger
    on = (f"on {type(trigger.event).__name__} ({trigger.stream} seq {trigger.seq})"
          if trigger is not None and trigger.event is not None else "on an input that is gone")
    mark = "  [counterfactual]" if counterfactual else ""
    return f"  {relative(ev.occurred_at - start):>10}  {c.kind.upper():<8} {c.service:<11} {fields['type']:<20} " \
           f"{text}  {on}{mark}"


def as_json(w: WhatIf, source: str) -> dict[str, Any]:
    m = w.measured
    first = w.changes[0].position[0] if w.changes else 0
    return {
        "job_id": w.job_id, "source": source,
        "settings": {k: {"recorded": a, "whatif": b} for k, (a, b) in w.settings.items()},
        "kept": w.outcome.kept, "restated": len(w.outcome.restated),
        "changes": [{"kind": c.kind, "service": c.service, "counterfactual": c.position[0] > first,
                     "decision": codec.to_builtins(c.event),
                     "trigger": None if c.trigger is None else {"stream": c.trigger.stream, "seq": c.trigger.seq,
                                                                "subject": c.trigger.subject},
                     "fields": [{"field": f, "recorded": _plain(a), "whatif": _plain(b)} for f, a, b in c.fields()]}
                    for c in w.changes],
        "dropped_inputs": [{"stream": s.stream, "seq": s.seq, "subject": s.subject} for s in w.outcome.dropped],
        "recorded": {"outcome": m.outcome, "wall_s": m.wall_s, "useful_s": m.useful_s, "goodput": m.goodput(),
                     "steps": m.done, "step_s": m.step_s},
        "whatif": {"ends": w.ends, "wall_s": w.wall_s, "useful_s": w.useful_s, "goodput": w.goodput,
                   "estimates": [{"what": e.what, "seconds": e.seconds, "note": e.note} for e in w.estimates]},
        "caveats": list(w.caveats),
    }


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else codec.to_json(_plain(value)).decode()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(value: Any) -> Any:
    try:
        return msgspec.to_builtins(value, str_keys=True)
    except TypeError:  # the diff's <absent> marker
        return repr(value)


COMMAND = Command("whatif", "replay a job's recorded inputs through the cores with changed policy settings: which "
                  "decisions change, and a first-order goodput estimate", add_arguments, run)
