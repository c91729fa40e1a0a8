"""Which drill faults may fire in an attempt (trainer/faults.py): a pinned one only in its attempt; an unpinned one
once, in the first attempt that reaches its step, which later attempts learn from the fired indices."""

from pathlib import Path

import pytest

from flightdeck.events.spec import FaultSpec, parse_spec, spec_toml
from flightdeck.trainer.config import from_env
from flightdeck.trainer.faults import Faults, live

CRASH = FaultSpec(kind="crash", step=8, rank=1)
SPIKE = FaultSpec(kind="loss_spike", step=20, rank=0)
PINNED = FaultSpec(kind="hang", step=5, rank=1, attempt=1)
SLOW = FaultSpec(kind="slow", step=3, rank=1, seconds=0.25)
SPEC = [CRASH, SPIKE, PINNED, SLOW]


def test_attempt_zero_arms_every_unpinned_fault_and_none_pinned_elsewhere() -> None:
    assert live(SPEC, 0, frozenset()) == [(0, CRASH), (1, SPIKE), (3, SLOW)]


def test_a_later_attempt_arms_what_has_not_fired_and_what_is_pinned_to_it() -> None:
    assert live(SPEC, 1, frozenset({0, 3})) == [(1, SPIKE), (2, PINNED)]
    assert live(SPEC, 2, frozenset({0, 1, 3})) == []


def test_a_pinned_fault_fires_in_its_attempt_even_if_listed_as_fired() -> None:
    assert (2, PINNED) in live(SPEC, 1, frozenset({2}))


def test_each_fires_once_per_attempt_even_when_a_rollback_repeats_its_step() -> None:
    f = Faults(SPEC, rank=1, attempt=0)
    assert f.due(7, 7) == []
    assert f.due(8, 8) == [(0, CRASH)]
    assert f.due(8, 8) == []  # the same step again after a rollback


def test_a_fired_spike_no_longer_poisons_the_data_of_later_attempts() -> None:
    assert Faults(SPEC, rank=1, attempt=0).poisoned(21)  # every rank shares the poisoned batches
    assert not Faults(SPEC, rank=1, attempt=1, fired=frozenset({1})).poisoned(21)


def test_slow_applies_from_its_step_in_the_attempt_it_fires_in_only() -> None:
    assert Faults(SPEC, rank=1, attempt=0).slow_seconds(2) == 0.0
    assert Faults(SPEC, rank=1, attempt=0).slow_seconds(9) == 0.25
    assert Faults(SPEC, rank=1, attempt=1, fired=frozenset({3})).slow_seconds(9) == 0.0


def test_the_agents_list_of_fired_faults_is_read_from_the_environment(tmp_path: Path) -> None:
    env = {"FLIGHTDECK_FIRED_FAULTS": "0,3", "FLIGHTDECK_DEVICE": "cpu"}
    assert from_env(env).fired == frozenset({0, 3})
    assert from_env({"FLIGHTDECK_DEVICE": "cpu"}).fired == frozenset()
    spec = tmp_path / "job.toml"
    spec.write_text('name = "d"\n[[faults]]\nkind = "crash"\nstep = 3\n'
                    '[[faults]]\nkind = "hang"\nstep = 5\nattempt = 1\n')
    restarted = {"FLIGHTDECK_SPEC": str(spec), "TORCHELASTIC_RESTART_COUNT": "1", "FLIGHTDECK_DEVICE": "cpu"}
    assert from_env(restarted).fired == frozenset({0})  # no platform: an unpinned fault had its first run
    with pytest.raises(ValueError, match="FLIGHTDECK_FIRED_FAULTS must list fault indices"):
        from_env({"FLIGHTDECK_FIRED_FAULTS": "crash", "FLIGHTDECK_DEVICE": "cpu"})


def test_pinned_and_unpinned_faults_survive_the_spec_file_the_agent_writes() -> None:
    spec = parse_spec('name = "d"\nslots = 2\n[[faults]]\nkind = "crash"\nstep = 8\nrank = 1\n'
                      '[[faults]]\nkind = "hang"\nstep = 5\nattempt = 1\n')
    assert [f.attempt for f in spec.faults] == [None, 1]
    assert parse_spec(spec_toml(spec)) == spec
