"""The AsyncAPI document other languages code against (docs/contract/asyncapi.json) is what the code generates today,
every reference in it resolves, every message recorded in a real run stood under its type's channel, and its
send operations are what the broker lets each role publish."""

import base64
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flightdeck.events import asyncapi, subjects
from flightdeck.events.catalog import ALL_TYPES
from flightdeck.services.shell.security import permissions

ROOT = Path(__file__).resolve().parents[2]
DOC_FILE = ROOT / "docs" / "contract" / "asyncapi.json"
HISTORIES = sorted((ROOT / "tests" / "fixtures" / "histories").glob("*.jsonl"))
DOC = asyncapi.document()


def resolve(ref: str) -> Any:
    node: Any = DOC
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [*([value["$ref"]] if isinstance(value.get("$ref"), str) else []),
                *(r for v in value.values() for r in refs(v))]
    if isinstance(value, list):
        return [r for v in value for r in refs(v)]
    return []


def pattern(address: str) -> re.Pattern[str]:
    """A channel address as a regex: each {parameter} one subject token."""
    return re.compile("^" + re.sub(r"\\\{\w+\\\}", "[A-Za-z0-9_-]+", re.escape(address)) + "$")


def test_the_checked_in_document_is_the_generated_one_and_every_reference_resolves() -> None:
    assert DOC_FILE.read_text() == asyncapi.render(), \
        "regenerate it: .venv/bin/python -m flightdeck.events.asyncapi > docs/contract/asyncapi.json"
    assert DOC["asyncapi"] == "3.0.0"
    for ref in refs(DOC):
        assert ref.startswith("#/") and resolve(ref) is not None, ref
    for key, ch in DOC["channels"].items():
        assert set(re.findall(r"\{(\w+)\}", ch["address"])) == set(ch["parameters"]), key
    for key, op in DOC["operations"].items():
        channel = op["channel"]["$ref"]
        assert all(m["$ref"].startswith(channel + "/messages/") for m in op["messages"]), key


def test_every_catalog_type_is_one_channels_message_with_an_author() -> None:
    where = {name: key for key, ch in DOC["channels"].items() for name in ch["messages"]}
    assert sorted(where) == sorted(t.__name__ for t in ALL_TYPES)
    assert sum(len(ch["messages"]) for ch in DOC["channels"].values()) == len(ALL_TYPES)  # no type in two channels
    sent = {m["$ref"].rsplit("/", 1)[-1] for op in DOC["operations"].values() for m in op["messages"]}
    assert sent == {t.__name__ for t in ALL_TYPES}


@pytest.mark.parametrize("history", HISTORIES, ids=[h.stem for h in HISTORIES])
def test_every_message_of_a_recorded_run_stood_under_its_types_channel(history: Path) -> None:
    by_type = {name: pattern(ch["address"]) for ch in DOC["channels"].values() for name in ch["messages"]}
    seen = set()
    for line in history.read_text().splitlines():
        row = json.loads(line)
        event = msgspec.msgpack.decode(base64.b64decode(row["data"]))
        name = event["type"]
        # The shipped fixtures were recorded before node records left the version fence: those stand numbered,
        # directly under the job, as the document's description says older histories hold them.
        legacy = name in subjects.NODE_RECORDS and event["job_version"] >= 1 and re.fullmatch(
            rf"fd\.ctl\.job\.[A-Za-z0-9_-]+\.{name}", row["subject"])
        assert legacy or by_type[name].match(row["subject"]), (name, row["subject"])
        seen.add(name)
    assert len(seen) > 20  # a real run's history: decisions, telemetry, clocks, checkpoints


def test_each_roles_send_operations_are_what_the_broker_lets_it_publish() -> None:
    users = {"console": permissions.console(), "agent": permissions.agent("n1"),
             **{s: permissions.service(s) for s in subjects.SERVICES},
             # a rank holds no credential: what it sends reaches the broker through its agent (events/ranklink.py)
             "trainer": permissions.agent("n1"), "shell": permissions.service("health")}
    values = {"job_id": "j-000001", "node": "n1", "rank": "0", "attempt": "0", "service": "health"}
    for key, op in DOC["operations"].items():
        role = key.split(".send.")[0]
        address = resolve(op["channel"]["$ref"])["address"]
        subject = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], address)
        assert users[role].may_publish(subject), (role, subject)
        if not subject.startswith("fd.ctl.job."):
            continue  # telemetry: the agent publishes its ranks' (checked against the rank: services/agent/links.py)
        others = [r for r, u in users.items() if r not in (role, "shell", "trainer") and u.may_publish(subject)
                  and f"{r}.send.{key.split('.send.')[1]}" not in DOC["operations"]]
        assert others == [], (subject, others)  # a decision: no one the document does not name may publish it
