"""The AsyncAPI 3.0 document of the broker's subjects, streams and messages, generated from the catalog
(events/catalog.py), the subject grammar (events/subjects.py) and who authors what (events/authors.py), so it cannot
drift from the code (tests/contract/test_asyncapi.py holds the checked-in file equal to this output).

    .venv/bin/python -m flightdeck.events.asyncapi > docs/contract/asyncapi.json

Payload schemas are events/contract.py's, under `components.schemas`.
"""

import json
import sys
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.authors import FLEET_TELEMETRY, JOB_TYPES, NODE_TYPES, RANK_TELEMETRY, TELEMETRY_TYPES
from flightdeck.events.base import Event, JobEvent, NodeEvent, RankEvent
from flightdeck.events.catalog import ALL_TYPES
from flightdeck.events.clock import ClockTick, CoreConfigured, DeadLettered
from flightdeck.events.contract import components
from flightdeck.events.logs import RankOutput

CONTENT_TYPE = "application/msgpack"
RANKS = "trainer"  # a job's ranks: every telemetry type no one else authors
SHELL = "shell"  # every service and node agent: its own clock and dead-letter subjects

ROLES = {RANKS: "a job's ranks", SHELL: "every service and node agent, on its own subject,",
         "agent": "a node agent", "console": "a person (the CLI, the Python client)"}

DESCRIPTION = """\
Every message is one catalog event encoded as a msgpack map: `type` names it, `schema_version` is its version
(a reader refuses versions it does not know), floats may be NaN or infinite, bytes are msgpack bin. Each stream keeps
its subjects: FD_CONTROL (fd.ctl.>, the decisions and requests; the source of truth), FD_TELEMETRY (fd.tel.>, what
ranks report), FD_LOGS (fd.log.>, what ranks print), FD_DEAD (fd.dead.>, what a service could not use).

A job's history is every message under fd.ctl.job.<job_id>.>, in stream order; `job_version` numbers it 1, 2, ...
with no gap. To append to it (JobSubmitted starts one; CancelRequested, PauseRequested, ResumeRequested,
CheckpointRequested and RollbackAsked are a person's requests to a running job), publish to the event's channel
through JetStream with these headers:
  Nats-Msg-Id: the event's event_id (a retry is then stored once);
  Nats-Expected-Last-Subject-Sequence: the stream sequence of the job's last message on fd.ctl.job.<job_id>.*
  (0 for a new job);
  Nats-Expected-Last-Subject-Sequence-Subject: fd.ctl.job.<job_id>.*
and job_version one above that last message's (1 for a new job). A "wrong last sequence" error means someone
appended first: read the last message again and retry. A node agent's records of its ranks (WorkersStarted,
WorkersExited) stand outside that numbering, under fd.ctl.job.<job_id>.node.<node>.<type>, with job_version 0 and no
expected-sequence headers; histories written before that hold them numbered, directly under the job. A new job's id
is <spec name>-<6 hex digits>, and occurred_at is unix seconds. Follow a job by reading fd.ctl.job.<job_id>.> (its
decisions: JobQueued ... JobCompleted, JobFailed or JobCancelled) and fd.tel.<job_id>.> (its ranks' steps) from the
start of each stream."""


def channel_of(t: type[Event]) -> tuple[str, str, dict[str, str]]:
    """(channel key, address, parameters) of the subjects every event of type `t` goes under."""
    name = t.__name__
    if t is RankOutput:
        return "logs", "fd.log.{job_id}.{attempt}.{rank}", {"job_id": "the job", "attempt": "the job's attempt",
                                                            "rank": "the rank that printed"}
    if issubclass(t, RankEvent):
        return f"telemetry.{name}", f"fd.tel.{{job_id}}.{{rank}}.{name}", {"job_id": "the job",
                                                                          "rank": "the rank it is about"}
    if issubclass(t, JobEvent) and name in subjects.NODE_RECORDS:
        return f"job.{name}", f"fd.ctl.job.{{job_id}}.node.{{node}}.{name}", {
            "job_id": "the job whose history it is in", "node": "the node whose agent records it"}
    if issubclass(t, JobEvent):
        return f"job.{name}", f"fd.ctl.job.{{job_id}}.{name}", {"job_id": "the job whose history it is in"}
    if issubclass(t, NodeEvent) and any(name in types for types in FLEET_TELEMETRY.values()):
        return f"fleet.{name}", f"fd.tel.{subjects.FLEET}.{{node}}.{name}", {"node": "the node whose agent sends it"}
    if issubclass(t, NodeEvent):
        return f"node.{name}", f"fd.ctl.node.{{node}}.{name}", {"node": "the node it is about"}
    if t in (ClockTick, CoreConfigured):
        return "clock", "fd.ctl.clock.{service}", {"service": "the service (or agent-<node>) whose clock it is"}
    if t is DeadLettered:
        return "dead", "fd.dead.{service}", {"service": "the service that could not use a message"}
    raise ValueError(f"{name} has no place in the subject grammar")


def authors_of(t: type[Event]) -> list[str]:
    name = t.__name__
    if t in (ClockTick, CoreConfigured, DeadLettered):
        return [SHELL]
    if t is RankOutput:
        return ["agent"]
    if name in RANK_TELEMETRY:  # the ranks', published for them by their node agent
        return [RANKS, "agent"]
    tables = TELEMETRY_TYPES if issubclass(t, RankEvent) else NODE_TYPES if issubclass(t, NodeEvent) else JOB_TYPES
    found = [role for role, types in (*tables.items(), *FLEET_TELEMETRY.items()) if name in types]
    return found or ([RANKS] if issubclass(t, RankEvent) else [])


def document() -> dict[str, Any]:
    _, schemas = components("#/components/schemas/{name}")
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for t in ALL_TYPES:
        name = t.__name__
        key, address, params = channel_of(t)
        stream = subjects.stream_of(address.replace("{", "").replace("}", ""))
        messages[name] = {"name": name, "contentType": CONTENT_TYPE,
                          "payload": {"$ref": f"#/components/schemas/{name}"},
                          "summary": (t.__doc__ or name).strip().split("\n\n")[0].replace("\n", " ")}
        ch = channels.setdefault(key, {
            "address": address, "messages": {},
            "parameters": {p: {"description": d} for p, d in params.items()},
            "description": f"Stored in {stream}.",
        })
        ch["messages"][name] = {"$ref": f"#/components/messages/{name}"}
        for author in authors_of(t):
            op = operations.setdefault(f"{author}.send.{key}", {
                "action": "send", "channel": {"$ref": f"#/channels/{key}"}, "messages": [],
                "summary": ROLES.get(author, f"the {author} service") + " publishes these",
            })
            op["messages"].append({"$ref": f"#/channels/{key}/messages/{name}"})
    return {
        "asyncapi": "3.0.0",
        "info": {"title": "Flightdeck events", "version": "1", "description": DESCRIPTION},
        "defaultContentType": CONTENT_TYPE,
        "servers": {"local": {"host": "127.0.0.1:4222", "protocol": "nats",
                              "description": "`flightdeck up`'s default broker (NATS with JetStream)"}},
        "channels": channels,
        "operations": dict(sorted(operations.items())),
        "components": {"messages": messages, "schemas": schemas},
    }


def render() -> str:
    return json.dumps(document(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
