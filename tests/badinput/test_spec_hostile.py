"""Hostile job specs: `parse_spec` refuses each with an InvalidSpec naming the field, before anything is
allocated; `flightdeck submit` exits 2 with that message and appends nothing; a JobSubmitted that bypassed
the CLI meets the same rules when a service reads it."""

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flightdeck.events import codec, subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobSubmitted
from flightdeck.events.spec import MAX_SPEC_BYTES, InvalidSpec, JobSpec, ModelSpec, TrainSpec, parse_spec
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.console.__main__ import main
from tests.conftest import ensure_streams_at

OK = 'name = "ok"\n'
HOSTILE: dict[str, tuple[str | bytes, str]] = {
    "negative slots": (OK + "slots = -1\n", "$.slots"),
    "zero slots": (OK + "slots = 0\n", "$.slots"),
    "a billion slots": (OK + "slots = 1000000000\n", "$.slots"),
    "steps 10**18": (OK + "[train]\nsteps = 1000000000000000000\n", "$.train.steps"),
    "steps past int64": (OK + "[train]\nsteps = 99999999999999999999\n", "$.train.steps"),
    "negative lr": (OK + "[train]\nlr = -0.1\n", "$.train.lr"),
    "nan spike z": (OK + "[policy]\nspike_z = nan\n", "$.policy.spike_z"),
    "inf heartbeat": (OK + "[policy]\nheartbeat_interval_s = inf\n", "$.policy.heartbeat_interval_s"),
    "seq_len past the cap": (OK + "[model]\nseq_len = 100000000\n", "$.model.seq_len"),
    "seq_len that blows up memory": (OK + "[model]\nseq_len = 131072\n", "TiB per rank"),
    "a model no rank holds": (OK + "[model]\nn_layer = 256\nd_model = 65536\nn_head = 256\n", "TiB per rank"),
    "traversal in the name": ('name = "../../etc"\n', "$.name"),
    "slash in the name": ('name = "a/b"\n', "$.name"),
    "absolute name": ('name = "/etc/passwd"\n', "$.name"),
    "NUL in the name": ('name = "a\\u0000b"\n', "$.name"),
    "newline after the name": ('name = "abc\\n"\n', "$.name"),
    "very long name": ('name = "' + "a" * 300 + '"\n', "$.name"),
    "fullwidth name": ('name = "\uff4a\uff4f\uff42"\n', "$.name"),
    "right-to-left override": ('name = "a\u202eb"\n', "$.name"),
    "dots in the name": ('name = "a.b"\n', "$.name"),
    "unknown key": (OK + "gpus = 8\n", "unknown field `gpus`"),
    "unknown nested key": (OK + "[model]\nlayers = 2\n", "unknown field `layers`"),
    "wrong type": (OK + 'slots = "2"\n', "$.slots"),
    "float for an int": (OK + "slots = 2.0\n", "$.slots"),
    "table for an int": (OK + "[slots]\nx = 1\n", "$.slots"),
    "name missing": ("slots = 1\n", "missing required field `name`"),
    "deeply nested arrays": (OK + "x = " + "[" * 5000 + "]" * 5000 + "\n", "nests"),
    "deeply nested tables": (OK + "[a" + ".b" * 3000 + "]\n", "unknown field `a`"),
    "many faults": (OK + "faults = [" + ", ".join(['{kind = "crash", step = 1}'] * 1000) + "]\n", "$.faults"),
    "a huge array": (OK + "x = [" + "1," * 600_000 + "]\n", "bytes, more than"),
    "not UTF-8": (b'name = "\xff"\n', "UTF-8"),
    "not TOML": ("\x00\x01\x02", "not valid TOML"),
    "a fault past the last step": (OK + '[[faults]]\nkind = "crash"\nstep = 500\n', "faults[0].step"),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_a_hostile_spec_is_refused_naming_the_field(case: str) -> None:
    text, names = HOSTILE[case]
    began = time.perf_counter()
    with pytest.raises(InvalidSpec) as info:
        parse_spec(text)
    assert names in str(info.value), str(info.value)
    assert time.perf_counter() - began < 5.0, "refused quickly, before anything big is built"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=300) | st.binary(max_size=300))
def test_any_text_is_a_spec_or_an_invalid_spec(text: str | bytes) -> None:
    try:
        parse_spec(text)
    except InvalidSpec as exc:
        assert str(exc)


@settings(max_examples=150, deadline=None)
@given(seq_len=st.integers(8, 131072), d_model=st.sampled_from([64, 1024, 8192, 65536]),
       n_layer=st.integers(1, 256), batch=st.integers(1, 1_000_000))
def test_an_accepted_spec_fits_in_a_rank(seq_len: int, d_model: int, n_layer: int, batch: int) -> None:
    """The memory guard is the only thing between a spec and a rank's allocations: whatever passes it fits."""
    from flightdeck.events.spec import MAX_RANK_BYTES, check, rank_memory_bytes
    spec = JobSpec(name="m", model=ModelSpec(seq_len=seq_len, d_model=d_model, n_layer=n_layer, n_head=1),
                   train=TrainSpec(batch_size=batch))
    try:
        check(spec)
    except InvalidSpec as exc:
        assert "TiB per rank" in str(exc) and rank_memory_bytes(spec) > MAX_RANK_BYTES
    else:
        assert rank_memory_bytes(spec) <= MAX_RANK_BYTES


SUBMIT_CASES = ["negative slots", "seq_len that blows up memory", "traversal in the name", "unknown key",
                "deeply nested arrays", "not UTF-8", "newline after the name"]


@pytest.mark.timeout(60)
def test_submit_exits_2_naming_the_field_and_appends_nothing(nats_server: broker_mod.Broker, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    ensure_streams_at(nats_server.url)
    for case in SUBMIT_CASES:
        text, names = HOSTILE[case]
        spec = tmp_path / f"{case.replace(' ', '-')}.toml"
        spec.write_bytes(text if isinstance(text, bytes) else text.encode())
        assert main(["submit", str(spec), "--nats", nats_server.url]) == 2, case
        err = capsys.readouterr().err
        assert names in err and err.count("\n") == 1, (case, err)
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:  # past the limit, sparse: the CLI must not read it whole
        f.truncate(MAX_SPEC_BYTES * 64)
    assert main(["submit", str(big), "--nats", nats_server.url]) == 2
    assert "bytes, more than" in capsys.readouterr().err
    assert _control_count(nats_server.url) == 0, "a refused spec appended something"


def _control_count(url: str) -> int:
    import asyncio

    async def go() -> int:
        store = await JetStreamStore.connect(url, name="spec-test")
        try:
            return await store.last_seq(subjects.CONTROL)
        finally:
            await store.close()
    return asyncio.run(go())


def test_a_submission_that_bypassed_the_cli_is_refused_by_its_readers() -> None:
    """JobSubmitted built by hand with a spec that passes each field's bounds but could never run."""
    spec = JobSpec(name="bomb", model=ModelSpec(seq_len=131072))
    wire = codec.encode(JobSubmitted(job_id="bomb-1", spec=spec))
    with pytest.raises(codec.InvalidEvent, match="TiB per rank"):
        codec.admit(wire)
