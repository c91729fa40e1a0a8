"""The JSON Schema other languages code against (docs/contract/events.schema.json) is what the code generates
today, and every recorded event fixture (tests/fixtures/events/, payloads old code wrote) validates against it."""

import base64
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from flightdeck.events import contract
from flightdeck.events.catalog import ALL_TYPES

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = ROOT / "docs" / "contract" / "events.schema.json"
FIXTURES = sorted((ROOT / "tests" / "fixtures" / "events").glob("*.msgpack"))
VALIDATOR = jsonschema.Draft202012Validator(contract.schema())


def test_the_checked_in_schema_is_the_generated_one() -> None:
    jsonschema.Draft202012Validator.check_schema(contract.schema())
    assert SCHEMA_FILE.read_text() == contract.render(), \
        "regenerate it: .venv/bin/python -m flightdeck.events.contract > docs/contract/events.schema.json"
    assert {d["$ref"].rsplit("/", 1)[-1] for d in contract.schema()["oneOf"]} == {t.__name__ for t in ALL_TYPES}


def json_view(value: Any) -> Any:
    """msgpack's bin as the schema writes bytes (base64 text); everything else as it decoded."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: json_view(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_view(v) for v in value]
    return value


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_every_recorded_event_validates_against_the_schema(fixture: Path) -> None:
    message = msgspec.msgpack.decode(fixture.read_bytes())  # plain maps: what a client in another language sees
    VALIDATOR.validate(json_view(message))


def test_a_message_that_breaks_the_contract_is_refused_by_it() -> None:
    wrong = {"type": "JobCancelled", "job_id": 7, "reason": "x"}
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(wrong)
