"""Old payloads stay decodable: every stored fixture (tests/fixtures/events) still decodes, to the type its
file names, with every field it was written with unchanged; and every catalog type has a fixture of its
current schema version. Add a missing one with `.venv/bin/python tests/fixtures/make_event_fixtures.py`."""

import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flightdeck.events import codec
from flightdeck.events.catalog import ALL_TYPES, BY_NAME

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "events"
FILES = sorted(FIXTURES.glob("*.msgpack"))
NAME = re.compile(r"^(?P<type>[A-Za-z0-9]+)\.v(?P<version>\d+)\.msgpack$")


def same(a: Any, b: Any) -> bool:
    """`b` (read now) keeps everything `a` (written then) held, NaN equal to NaN (the codec must keep NaN losses).
    A struct read now may hold fields added since, at their defaults (a spec's new `[entrypoint]`, say)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() <= b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def test_every_type_has_a_fixture_of_its_current_schema() -> None:
    missing = [f"{cls.__name__}.v{cls.SCHEMA}.msgpack" for cls in ALL_TYPES
               if not (FIXTURES / f"{cls.__name__}.v{cls.SCHEMA}.msgpack").exists()]
    assert not missing, f"no fixture for {missing}: run tests/fixtures/make_event_fixtures.py and commit them"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_fixture_still_decodes_unchanged(path: Path) -> None:
    m = NAME.match(path.name)
    assert m, f"{path.name}: fixtures are named <Type>.v<schema>.msgpack"
    assert m["type"] in BY_NAME, f"{m['type']} is no longer in the catalog: a tag may never be dropped or reused"
    wire = path.read_bytes()
    event = codec.decode(wire)
    assert type(event).__name__ == m["type"] and event.schema_version == int(m["version"])
    written = msgspec.msgpack.decode(wire)
    now = msgspec.to_builtins(event, builtin_types=(bytes,))
    changed = {k: (v, now.get(k)) for k, v in written.items() if not same(v, now.get(k))}
    assert not changed, f"{path.name}: fields read back differently (written, read): {changed}"


def test_the_fixtures_keep_nan_and_inf() -> None:
    event = codec.decode((FIXTURES / "NonFiniteLoss.v1.msgpack").read_bytes())
    assert math.isnan(event.loss) and event.grad_norm == math.inf  # type: ignore[attr-defined]
