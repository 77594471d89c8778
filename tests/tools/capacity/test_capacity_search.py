"""Bisection of one policy's capacity (tools/capacity/search.py), against attainment functions with a known
threshold."""

import pytest

from tools.capacity.search import Bisection, round_rate, warm_grow


def run(search: Bisection, threshold: float) -> Bisection:
    while (rate := search.next_rate()) is not None:
        search.record(rate, rate <= threshold)
    return search


@pytest.mark.parametrize("start", [0.01, 0.1, 0.37, 2.0])
@pytest.mark.parametrize("threshold", [0.05, 0.3, 1.7])
def test_converges_within_precision_from_any_start(start, threshold):
    s = run(Bisection(start, precision=0.05, max_probes=40), threshold)
    assert s.status == "converged"
    assert s.capacity <= threshold < s.hi
    assert s.hi / s.capacity <= 1.05 + 1e-9 or round_rate((s.capacity * s.hi) ** 0.5) in (s.capacity, s.hi)


def test_brackets_up_then_bisects_geometrically():
    s = Bisection(1.0, precision=0.05, grow=1.5)
    assert s.next_rate() == 1.0
    s.record(1.0, True)
    assert s.next_rate() == 1.5
    s.record(1.5, False)
    assert s.next_rate() == round_rate(1.5**0.5)


def test_brackets_down_when_the_start_fails():
    s = Bisection(1.0, grow=2.0)
    s.record(1.0, False)
    assert s.next_rate() == 0.5
    assert s.capacity is None


def test_nothing_passes_above_the_floor():
    s = run(Bisection(1.0, min_rate=0.1, grow=2.0, max_probes=20), threshold=0.01)
    assert s.status == "below min" and s.capacity is None


def test_everything_passes_up_to_the_ceiling():
    s = run(Bisection(1.0, max_rate=3.0, grow=2.0, max_probes=20), threshold=100.0)
    assert s.status == "above max" and s.capacity == 3.0


def test_probe_budget_stops_the_search():
    s = run(Bisection(1.0, precision=0.001, max_probes=3), threshold=0.77)
    assert len(s.probes) == 3 and s.status == "out of probes"
    assert s.capacity <= 0.77 < s.hi


def test_non_monotone_verdicts_are_an_error():
    s = Bisection(1.0)
    s.record(1.0, False)
    with pytest.raises(ValueError, match="not monotone"):
        s.record(2.0, True)


def test_rates_are_rounded_so_reruns_ask_for_stored_rates():
    assert round_rate(0.123456) == 0.1235
    a = run(Bisection(0.3), 0.2)
    b = run(Bisection(0.3), 0.2)
    assert a.probes == b.probes


@pytest.mark.parametrize(
    "kw", [{"start": 0.0}, {"start": 1.0, "precision": 0}, {"start": 1.0, "grow": 1.0}, {"start": 1.0, "max_probes": 0}]
)
def test_bad_settings(kw):
    with pytest.raises(ValueError):
        Bisection(**kw)


@pytest.mark.parametrize("start", [0.0977, 0.3, 0.5373, 1.234])
def test_a_warm_step_closes_the_bracket_after_rounding(start):
    s = Bisection(start, precision=0.1, grow=warm_grow(0.1))
    s.record(s.next_rate(), True)
    s.record(s.next_rate(), False)
    assert s.status == "converged" and len(s.probes) == 2
