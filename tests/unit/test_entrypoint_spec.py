"""[entrypoint] in a job spec: what a user's job runs, validated like every field (the error names the field)."""

import pytest

from flightdeck.events.spec import InvalidSpec, parse_spec, spec_toml

BASE = 'name = "byo"\nslots = 2\n'


def test_an_entrypoint_job_reads_back_the_same_and_skips_the_built_in_models_rules() -> None:
    # batch_size 1 < slots would be refused for the built-in trainer; a user's script has its own batches
    spec = parse_spec(BASE + '[train]\nbatch_size = 1\n[entrypoint]\ncommand = ["python", "train.py", "--lr", '
                             '"3e-4"]\ncwd = "jobs/a"\nenv = { HF_HUB_OFFLINE = "1" }\n')
    assert spec.entrypoint is not None and spec.entrypoint.command == ["python", "train.py", "--lr", "3e-4"]
    assert parse_spec(spec_toml(spec)) == spec
    builtin = parse_spec(BASE)
    assert builtin.entrypoint is None and parse_spec(spec_toml(builtin)) == builtin


@pytest.mark.parametrize(("entry", "why"), [
    ("command = []", r"length >= 1 - at `\$.entrypoint.command`"),
    ('command = ["  "]', r"entrypoint.command\[0\] is empty"),
    ('command = "python train.py"', r"Expected `array`, got `str` - at `\$.entrypoint.command`"),
    ('command = ["python", "a\\u0000b"]', r"entrypoint.command\[1\]"),
    ('command = ["python"]\nenv = { RANK = "3" }', r"entrypoint.env.RANK is set by the node agent"),
    ('command = ["python"]\nenv = { FLIGHTDECK_JOB_ID = "x" }', r"entrypoint.env.FLIGHTDECK_JOB_ID is set by"),
    ('command = ["python"]\nenv = { "1BAD" = "x" }', r"entrypoint.env"),
    ('command = ["python"]\nshell = true', r"unknown field `shell`"),
], ids=["empty", "blank", "a-string", "nul", "rank", "own-variable", "bad-name", "unknown-key"])
def test_a_bad_entrypoint_is_refused_naming_the_field(entry: str, why: str) -> None:
    with pytest.raises(InvalidSpec, match=why):
        parse_spec(BASE + "[entrypoint]\n" + entry + "\n")
