"""`flightdeck verify JOB`: re-run every service's pure core over the job's recorded inputs and check that each
recorded decision comes back exactly; exit 1 showing the first divergence otherwise (services/tools/audit/verify.py)."""

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from flightdeck.events import codec, subjects
from flightdeck.events.store import Stored
from flightdeck.events.subjects import InvalidSubjectToken
from flightdeck.services.shell.broker import nats_url
from flightdeck.services.tools.audit import cores, resume
from flightdeck.services.tools.audit.verify import Divergence, NoSuchJob, Verdict, verify
from flightdeck.services.tools.cli import EXIT_ERROR, EXIT_INCOMPLETE, EXIT_NOT_FOUND, Command, UserError
from flightdeck.services.tools.history import add_history_arguments, history_from_args
from flightdeck.services.tools.history.archived import Gap
from flightdeck.services.tools.history.library import (
    HistoryNotFound,
    control_stream_id,
    data_dir_of,
    from_broker,
    library_path,
)

MAX_VALUE_CHARS = 160


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_history_arguments(parser)
    parser.add_argument("--all", action="store_true", help="list every divergence, not only the first")
    parser.add_argument("--json", action="store_true", help="the verdict as one JSON object")
    parser.add_argument("--full", action="store_true", help="re-derive every decision, not only those since the "
                        "last clean verify of the job (its mark in the data dir)")


def run(args: argparse.Namespace) -> int:
    verdict, source, gaps = asyncio.run(_verify(args))
    if args.json:
        sys.stdout.write(codec.to_json({**as_json(verdict, source), "gaps": [str(g) for g in gaps]}).decode() + "\n")
    elif gaps:
        sys.stdout.write("\n".join(incomplete(verdict, source, gaps)) + "\n")
    else:
        sys.stdout.write("\n".join(report(verdict, source, every=args.all)) + "\n")
    if gaps:
        return EXIT_INCOMPLETE
    return 0 if verdict.ok else EXIT_ERROR


def incomplete(verdict: Verdict, source: str, gaps: Sequence[Gap]) -> list[str]:
    """A history with inputs missing: the ranges first; what the replay found is not called a divergence, since
    a decision that differs may rest on what is missing."""
    lines = [f"verify {verdict.job_id} ({source}): INCOMPLETE: the history lacks inputs, so its decisions cannot all "
             "be checked", *(f"  missing: {g}" for g in gaps)]
    differ = len(verdict.divergences)
    lines.append("  over what remains, every recorded decision reproduced" if not differ else
                 f"  over what remains, {differ} recorded decision(s) were not reproduced; each may rest on the "
                 "missing inputs (--json lists them)")
    return lines


async def _verify(args: argparse.Namespace) -> tuple[Verdict, str, tuple[Gap, ...]]:
    """From the broker, a verify goes on from the job's last clean verify (audit/resume.py) and leaves a mark when
    clean; a history file or an imported one is verified whole."""
    mark: resume.Resume | None = None
    stream = ""
    if args.from_file is None and args.job and not library_path(args.data_dir, args.job).exists():
        try:
            subjects.token(args.job)
        except InvalidSubjectToken as exc:
            raise HistoryNotFound(str(exc)) from None
        url = nats_url(args.nats)
        stream = await control_stream_id(url)
        if not args.full and stream:
            mark = resume.load(data_dir_of(args.data_dir), args.job, stream, cores.cores())
        since = (mark.control_from, mark.telemetry_from) if mark is not None else (1, 1)
        history = await from_broker(url, args.job, since=since)
    else:
        history = await history_from_args(args)
    try:
        verdict = await verify(history.store, history.job_id, resume=mark)
    except NoSuchJob:
        raise UserError(f"{history.source} holds no control event of job {history.job_id!r}", EXIT_NOT_FOUND) from None
    if stream and verdict.ok and not history.gaps:
        counts = {c.service: (c.control_inputs, c.telemetry_inputs, c.decisions, c.effects) for c in verdict.checks}
        try:
            resume.save(data_dir_of(args.data_dir), history.job_id, stream, verdict.horizon, verdict.fleet,
                        verdict.folders, counts)
        except OSError as exc:  # the verdict stands; the next verify is whole
            sys.stderr.write(f"note: the verify's mark was not saved: {exc}\n")
    return verdict, history.source, history.gaps


def report(verdict: Verdict, source: str, *, every: bool = False) -> list[str]:
    """The summary (per service: inputs folded, decisions checked), then the first divergence (or all)."""
    head = "OK: every recorded decision reproduced" if verdict.ok else f"DIVERGED: {len(verdict.divergences)} " \
        "divergence(s) between the recorded decisions and a replay of the recorded inputs"
    since = f", decisions since the clean verify up to seq {verdict.resumed_from}" if verdict.resumed_from else ""
    lines = [f"verify {verdict.job_id} ({source}, inputs up to FD_CONTROL seq {verdict.horizon}{since}): {head}", ""]
    lines.append(f"  {'service':<12} {'control in':>10} {'telemetry in':>12} {'decisions':>9} {'effects':>7} "
                 f"{'dead live/replay':>16}")
    for c in verdict.checks:
        dead = f"{len(c.dead_live)}/{len(c.dead_replay)}" + (f" (+{c.skipped} given up)" if c.skipped else "")
        lines.append(f"  {c.service:<12} {c.control_inputs:>10} {c.telemetry_inputs:>12} {c.decisions:>9} "
                     f"{c.effects:>7} {dead:>16}")
    lines += ["", *(f"  note: {n}" for n in verdict.notes)]
    shown = verdict.divergences if every else verdict.divergences[:1]
    for i, d in enumerate(shown):
        lines += ["", *describe(d, first=i == 0)]
    if len(verdict.divergences) > len(shown):
        lines.append(f"\n  ... and {len(verdict.divergences) - len(shown)} more (--all lists them)")
    return lines


def describe(d: Divergence, *, first: bool) -> list[str]:
    title = "first divergence" if first else "divergence"
    out = [f"{title} ({d.service}, {d.kind}): {d.detail}"]
    out.append(f"  input:    {_input(d.input)}")
    if d.msg_id:
        out.append(f"  decision: {d.msg_id}")
    if d.recorded is not None:
        out.append(f"  recorded: {_event(d.recorded)}")
    if d.replayed is not None:
        out.append(f"  replayed: {_event(d.replayed)}")
    for name, recorded, replayed in d.fields():
        out.append(f"  field {name}: recorded {_short(recorded)}, replayed {_short(replayed)}")
    return out


def as_json(verdict: Verdict, source: str) -> dict[str, Any]:
    return {
        "job_id": verdict.job_id, "source": source, "ok": verdict.ok, "horizon": verdict.horizon,
        "resumed_from": verdict.resumed_from,
        "services": [{"service": c.service, "control_inputs": c.control_inputs,
                      "telemetry_inputs": c.telemetry_inputs, "decisions": c.decisions, "effects": c.effects,
                      "dead_lettered_live": sorted(list(k) for k in c.dead_live),
                      "dead_lettered_replay": sorted(list(k) for k in c.dead_replay), "given_up": c.skipped}
                     for c in verdict.checks],
        "divergences": [{"service": d.service, "kind": d.kind, "position": d.position, "detail": d.detail,
                         "input": _input_json(d.input), "msg_id": d.msg_id,
                         "recorded": codec.to_builtins(d.recorded) if d.recorded is not None else None,
                         "replayed": codec.to_builtins(d.replayed) if d.replayed is not None else None,
                         "fields": [{"field": f, "recorded": _jsonable(a), "replayed": _jsonable(b)}
                                    for f, a, b in d.fields()]}
                        for d in verdict.divergences],
        "notes": verdict.notes,
    }


def _input(s: Stored | None) -> str:
    if s is None:
        return "(not in the history)"
    kind = type(s.event).__name__ if s.event is not None else f"<undecodable: {s.error}>"
    return f"{s.stream} seq {s.seq}  {s.subject}  {kind}" + (f"  (msg id {s.msg_id})" if s.msg_id else "")


def _input_json(s: Stored | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"stream": s.stream, "seq": s.seq, "subject": s.subject, "msg_id": s.msg_id,
            "type": type(s.event).__name__ if s.event is not None else None}


def _event(event: Any) -> str:
    fields = codec.to_builtins(event)
    return _short(fields, limit=400)


def _short(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    text = codec.to_json(_jsonable(value)).decode()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _jsonable(value: Any) -> Any:
    try:
        return msgspec.to_builtins(value, str_keys=True)
    except TypeError:  # a value msgspec cannot take (the diff's <absent> marker)
        return repr(value)


COMMAND = Command("verify", "re-run the services' pure cores over a job's recorded inputs and check every "
                  "recorded decision is reproduced (exit 1 at the first divergence)", add_arguments, run)
