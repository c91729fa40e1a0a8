"""Job specs: the documented example is accepted as written; a spec a user must fix is refused with a
message that names the field (unknown keys, negative or huge sizes, unsafe names, faults on absent ranks)."""

import pytest

from flightdeck.events.spec import FaultSpec, InvalidSpec, JobSpec, parse_spec

EXAMPLE = """\
name = "tiny-drill"
priority = 50
slots = 2
[model]
n_layer = 2
n_head = 2
d_model = 64
seq_len = 64
[train]
steps = 300
batch_size = 8
lr = 0.003
checkpoint_every = 25
seed = 1
[policy]
max_restarts = 3
[[faults]]
kind = "crash"
rank = 1
step = 80
[[faults]]
kind = "loss_spike"
step = 180
"""


def test_the_documented_example_is_accepted_as_written() -> None:
    spec = parse_spec(EXAMPLE)
    assert isinstance(spec, JobSpec)
    assert (spec.name, spec.priority, spec.slots) == ("tiny-drill", 50, 2)
    assert (spec.model.n_layer, spec.model.n_head, spec.model.d_model, spec.model.seq_len) == (2, 2, 64, 64)
    assert (spec.train.steps, spec.train.batch_size, spec.train.lr) == (300, 8, 0.003)
    assert (spec.train.checkpoint_every, spec.train.seed, spec.policy.max_restarts) == (25, 1, 3)
    assert spec.faults == [FaultSpec(kind="crash", rank=1, step=80), FaultSpec(kind="loss_spike", step=180)]
    assert parse_spec(EXAMPLE.encode()) == spec


def with_line(section: str, line: str) -> str:
    """The example with `line` added at the end of `[section]` ("" for the top level)."""
    if not section:
        return f"{line}\n{EXAMPLE}"
    return EXAMPLE.replace(f"[{section}]\n", f"[{section}]\n{line}\n", 1)


def replaced(old: str, new: str) -> str:
    assert old in EXAMPLE
    return EXAMPLE.replace(old, new, 1)


REFUSED = [
    # negative and zero sizes
    (replaced("slots = 2", "slots = -2"), r"\$\.slots"),
    (replaced("batch_size = 8", "batch_size = 0"), r"\$\.train\.batch_size"),
    (replaced("n_layer = 2", "n_layer = -1"), r"\$\.model\.n_layer"),
    (replaced("lr = 0.003", "lr = -0.003"), r"\$\.train\.lr"),
    (replaced("step = 80", "step = -80"), r"\$\.faults\[0\]\.step"),
    (replaced("max_restarts = 3", "max_restarts = -1"), r"\$\.policy\.max_restarts"),
    # unknown keys, anywhere
    (with_line("", "gpus = 2"), r"unknown field `gpus`"),
    (with_line("model", "n_embd = 64"), r"unknown field `n_embd` - at `\$\.model`"),
    (with_line("policy", "max_retries = 3"), r"unknown field `max_retries` - at `\$\.policy`"),
    (replaced('kind = "loss_spike"', 'kind = "loss_spike"\nrnak = 1'), r"unknown field `rnak` - at `\$\.faults\[1\]`"),
    # names that would escape a subject, a path or an object key
    (replaced('name = "tiny-drill"', 'name = "../etc"'), r"\$\.name"),
    (replaced('name = "tiny-drill"', 'name = "a/b"'), r"\$\.name"),
    (replaced('name = "tiny-drill"', 'name = "a..b"'), r"\$\.name"),
    (replaced('name = "tiny-drill"', 'name = "job.one"'), r"\$\.name"),
    (replaced('name = "tiny-drill"', 'name = ""'), r"\$\.name"),
    (replaced('name = "tiny-drill"', f'name = "{"x" * 64}"'), r"\$\.name"),
    # huge values
    (replaced("slots = 2", "slots = 1000000"), r"\$\.slots"),
    (replaced("steps = 300", "steps = 9223372036854775807"), r"\$\.train\.steps"),
    (replaced("d_model = 64", "d_model = 1048576"), r"\$\.model\.d_model"),
    (replaced("seq_len = 64", "seq_len = 10000000"), r"\$\.model\.seq_len"),
    (replaced("priority = 50", "priority = 100000"), r"\$\.priority"),
    (replaced("lr = 0.003", "lr = 1e300"), r"\$\.train\.lr"),
    (replaced("lr = 0.003", "lr = inf"), r"\$\.train\.lr"),
    # wrong types and values
    (replaced("n_head = 2", 'n_head = "two"'), r"\$\.model\.n_head"),
    (replaced('kind = "crash"', 'kind = "meteor"'), r"\$\.faults\[0\]\.kind"),
    (replaced('name = "tiny-drill"\n', ""), r"missing required field `name`"),
    # consistent fields
    (replaced("rank = 1", "rank = 2"), r"faults\[0\]\.rank \(2\) must be below slots \(2\)"),
    (replaced("step = 180", "step = 300"), r"faults\[1\]\.step \(300\) must be below train\.steps \(300\)"),
    (replaced("n_head = 2", "n_head = 3"), r"model\.d_model \(64\) must be a multiple of model\.n_head \(3\)"),
    (replaced("batch_size = 8", "batch_size = 1"), r"train\.batch_size \(1\) must be at least slots \(2\)"),
    (with_line("policy", "min_slots = 3"), r"policy\.min_slots \(3\) must not exceed slots \(2\)"),
]


@pytest.mark.parametrize(("text", "names"), REFUSED, ids=[names for _, names in REFUSED])
def test_a_spec_to_fix_is_refused_naming_the_field(text: str, names: str) -> None:
    with pytest.raises(InvalidSpec, match=names):
        parse_spec(text)


def test_text_that_is_not_toml_is_refused_as_such() -> None:
    with pytest.raises(InvalidSpec, match="not valid TOML"):
        parse_spec("name = \n[model")


@pytest.mark.parametrize(("text", "words"), [
    ('name = "Bad Name!"', "lowercase letters, digits and '-', starting with a letter or digit, at most 63"),
    ('name = "j"\n[entrypoint]\ncommand = ["python"]\nenv = {"1X" = "y"}', "letters, digits and '_', not starting"),
    ('name = "j"\n[entrypoint]\ncommand = ["a\\u0000b"]', "text without a NUL character"),
])
def test_what_a_pattern_allows_is_said_in_words_not_as_a_regex(text: str, words: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        parse_spec(text)
    assert words in str(err.value) and "\\" not in str(err.value) and "regex" not in str(err.value), str(err.value)
