"""The subject grammar and the streams that hold each kind of subject.

Why it works this way: docs/internals.md, "1. The event log".
"""

import functools
import re

CONTROL = "FD_CONTROL"
TELEMETRY = "FD_TELEMETRY"
DEAD = "FD_DEAD"
LOGS = "FD_LOGS"
STATE = "FD_STATE"  # services' snapshots of their folded state (services/shell/snapshots.py): not history
# The built-in services: each has its clock and dead-letter subjects, durable consumer and broker user.
SERVICES = ("scheduler", "resources", "checkpoints", "health", "resharder", "archiver")

STREAM_SUBJECTS: dict[str, str] = {CONTROL: "fd.ctl.>", TELEMETRY: "fd.tel.>", DEAD: "fd.dead.>", LOGS: "fd.log.>",
                                   STATE: "fd.state.>"}
HISTORY_STREAMS = (CONTROL, TELEMETRY, DEAD, LOGS)  # what a job's history is made of (export, import, archive)

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")  # \Z: $ would let a trailing newline through


class InvalidSubjectToken(ValueError):
    pass


def token(value: str | int) -> str:
    """A value made safe to stand as one subject token: no dots, spaces or wildcards."""
    text = str(value)
    if not _TOKEN.match(text):
        raise InvalidSubjectToken(f"{text!r} cannot be a subject token: use letters, digits, '-' and '_'")
    return text


def job(job_id: str, type_name: str) -> str:
    return f"fd.ctl.job.{token(job_id)}.{token(type_name)}"


def job_all(job_id: str) -> str:
    """Everything of one job's history: its versioned events and its node agents' records."""
    return f"fd.ctl.job.{token(job_id)}.>"


# A node agent's records of its own ranks (started, exited). They stand under their node's token, outside the
# fence that numbers a job's history: at a restart every node records at once, and 512 writers racing one fence
# made a 4,096-rank restart take 8-10 s. They carry no job_version; stream order still places them in the history.
NODE_RECORDS = frozenset({"WorkersStarted", "WorkersExited"})


def job_node(job_id: str, node_id: str, type_name: str) -> str:
    """Where a node agent's record of one job stands: fd.ctl.job.<job>.node.<node>.<type>."""
    return f"fd.ctl.job.{token(job_id)}.node.{token(node_id)}.{token(type_name)}"


def job_versioned(job_id: str) -> str:
    """The fence of a job's history: its versioned events, one token after the job (node records have three)."""
    return f"fd.ctl.job.{token(job_id)}.*"


def job_types(*type_names: str) -> tuple[str, ...]:
    """Filters for these types in every job; a node record's both ways (histories from before NODE_RECORDS hold
    them versioned, directly under the job)."""
    out: list[str] = []
    for t in type_names:
        out.append(f"fd.ctl.job.*.{token(t)}")
        if t in NODE_RECORDS:
            out.append(f"fd.ctl.job.*.node.*.{t}")
    return tuple(out)


def node(node_id: str, type_name: str) -> str:
    return f"fd.ctl.node.{token(node_id)}.{token(type_name)}"


def clock(service: str) -> str:
    return f"fd.ctl.clock.{token(service)}"


def telemetry(job_id: str, rank: int, type_name: str) -> str:
    return f"fd.tel.{token(job_id)}.{token(rank)}.{token(type_name)}"


FLEET = "_fleet"  # the job token of a node's own telemetry: no job's id (theirs are <name>-<hex>) starts with "_"


def fleet_telemetry(node_id: str, type_name: str) -> str:
    """A node agent's own telemetry, about no job: fd.tel._fleet.<node>.<type>."""
    return f"fd.tel.{FLEET}.{token(node_id)}.{token(type_name)}"


def telemetry_of(job_id: str, type_name: str) -> str:
    """One event type from every rank of a job."""
    return f"fd.tel.{token(job_id)}.*.{token(type_name)}"


def telemetry_job(job_id: str) -> str:
    return f"fd.tel.{token(job_id)}.>"


def logs(job_id: str, attempt: int, rank: int) -> str:
    return f"fd.log.{token(job_id)}.{token(attempt)}.{token(rank)}"


def logs_filter(job_id: str, attempt: int | None = None, rank: int | None = None) -> str:
    """What a reader of one job's output subscribes to: every attempt and rank unless given."""
    return f"fd.log.{token(job_id)}.{'*' if attempt is None else token(attempt)}.{'*' if rank is None else token(rank)}"


def dead(service: str) -> str:
    return f"fd.dead.{token(service)}"


def stream_of(subject: str) -> str:
    for stream, pattern in STREAM_SUBJECTS.items():
        if matches(pattern, subject):
            return stream
    raise InvalidSubjectToken(f"subject {subject!r} belongs to no Flightdeck stream")


def job_of(subject: str) -> str | None:
    """The job id a control, telemetry or logs subject is about, if any."""
    parts = subject.split(".")
    if parts[:3] == ["fd", "ctl", "job"] and len(parts) >= 4:
        return parts[3]
    if parts[:2] in (["fd", "tel"], ["fd", "log"]) and len(parts) >= 3:
        return parts[2]
    return None


@functools.lru_cache(maxsize=1 << 16)  # few patterns, subjects repeating: replays and the explorer ask millions
def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` the rest (one token or more)."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, p in enumerate(pat):
        if p == ">":
            return len(sub) > i
        if i >= len(sub) or (p != "*" and p != sub[i]):
            return False
    return len(pat) == len(sub)


@functools.lru_cache(maxsize=1 << 16)
def matches_any(patterns: tuple[str, ...], subject: str) -> bool:
    """Whether `subject` matches one of `patterns` (a consumer's or a reader's filters)."""
    return any(matches(p, subject) for p in patterns)
