"""What `flightdeck whatif --set KEY=VALUE` may change, checked the way a submitted job spec is.

Every `policy.*` field of the job's spec (events/spec.py PolicySpec) drives a core, so a what-if replays it.
`train.checkpoint_every` is the trainer's (no core decides when ranks checkpoint): the recorded checkpoints stay,
and its effect is estimated from the recorded incidents instead (whatif.py).
"""

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from flightdeck.events.spec import InvalidSpec, JobSpec, PolicySpec, parse_spec, spec_builtins

TRAINER_KEYS = ("train.checkpoint_every",)
CHANGEABLE = (*(f"policy.{name}" for name in PolicySpec.__struct_fields__), *TRAINER_KEYS)


class BadSetting(ValueError):
    """A --set the user must fix; the message names the key and what is allowed."""


def parse(items: Sequence[str]) -> dict[str, Any]:
    """`["policy.spike_z=8", ...]` -> {"policy.spike_z": 8}; unknown keys and malformed items refused."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise BadSetting(f"--set {item!r}: write KEY=VALUE, e.g. --set policy.spike_z=8")
        if key not in CHANGEABLE:
            raise BadSetting(unknown(key))
        if key in out:
            raise BadSetting(f"--set {key} is given twice")
        out[key] = _scalar(raw.strip())
    return out


def unknown(key: str) -> str:
    if key.partition(".")[0] in JobSpec.__struct_fields__ and not key.startswith("policy."):
        return (f"{key!r} is not a setting a what-if can replay: the recorded telemetry is what the ranks did with "
                f"the job's {key.partition('.')[0]} as submitted; change policy.<field> or {', '.join(TRAINER_KEYS)}")
    near = difflib.get_close_matches(key, CHANGEABLE, n=3, cutoff=0.75) or difflib.get_close_matches(
        f"policy.{key.rpartition('.')[2]}", CHANGEABLE, n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    return (f"unknown setting {key!r}{hint}: a what-if can change the job's policy.<field> "
            f"({', '.join(n.removeprefix('policy.') for n in CHANGEABLE if n.startswith('policy.'))}) "
            f"or {', '.join(TRAINER_KEYS)}")


def apply(spec: JobSpec, settings: Mapping[str, Any]) -> JobSpec:
    """`spec` with `settings` in place, validated like a submitted spec (ranges, min_slots <= slots ...)."""
    data = spec_builtins(spec)
    for key, value in settings.items():
        section, _, name = key.partition(".")
        data[section][name] = value
    try:
        return parse_spec(msgspec.toml.encode(data))
    except InvalidSpec as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        raise BadSetting(f"{given}: {str(exc).removeprefix('invalid job spec: ')}") from None


def changed(before: JobSpec, after: JobSpec) -> dict[str, tuple[Any, Any]]:
    """key -> (recorded value, what-if value) for every changeable key that differs."""
    out: dict[str, tuple[Any, Any]] = {}
    for key in CHANGEABLE:
        section, _, name = key.partition(".")
        old, new = getattr(getattr(before, section), name), getattr(getattr(after, section), name)
        if old != new:
            out[key] = (old, new)
    return out


def _scalar(raw: str) -> Any:
    """A TOML value (8, 2.5, true, "x"); anything else is taken as a string, which validation then refuses
    with the type it wanted."""
    try:
        return msgspec.toml.decode(f"v = {raw}".encode())["v"]
    except msgspec.DecodeError:
        return raw
