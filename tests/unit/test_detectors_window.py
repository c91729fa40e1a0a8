"""The incremental order statistics behind the detectors agree with a brute-force median and MAD."""

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.services.health.window import RobustWindow, mad_of_sorted, median_without

values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


def brute_mad(xs: list[float]) -> float:
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs)


@settings(max_examples=300, deadline=None)
@given(st.lists(values | st.sampled_from([0.0, 1.0, 1.0, 2.0]), min_size=1, max_size=80), st.integers(1, 30))
def test_window_median_and_mad_match_brute_force(xs: list[float], size: int) -> None:
    window = RobustWindow(size)
    for i, x in enumerate(xs):
        window.add(x)
        recent = xs[max(0, i + 1 - size): i + 1]
        assert len(window) == len(recent)
        assert window.median() == statistics.median(recent)
        assert abs(window.mad() - brute_mad(recent)) <= 1e-9 * (1 + abs(brute_mad(recent)))


@given(st.lists(values, min_size=1, max_size=60))
def test_mad_of_sorted_matches_brute_force(xs: list[float]) -> None:
    s = sorted(xs)
    assert abs(mad_of_sorted(s, statistics.median(s)) - brute_mad(xs)) <= 1e-9 * (1 + brute_mad(xs))


@given(st.lists(values, min_size=2, max_size=60), st.data())
def test_median_without_is_the_median_of_the_others(xs: list[float], data: st.DataObject) -> None:
    s = sorted(xs)
    i = data.draw(st.integers(0, len(s) - 1))
    assert median_without(s, i) == statistics.median(s[:i] + s[i + 1:])
