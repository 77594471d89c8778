"""Fixed SLOs and attainment (tools/capacity/slo.py)."""

import pytest

from tests.tools.capacity.capacity_fixtures import records
from tools.capacity.slo import Slos, attainment


def test_attainment_counts_every_request_sent():
    recs = records(10, good=7)
    recs[0].status = "rejected"  # within the SLOs by its times, but rejected: a miss
    recs[1].status, recs[1].end_s = "unfinished", None
    assert attainment(recs, Slos(2.0, 0.35)) == pytest.approx(0.5)


def test_tpot_slo_binds():
    recs = records(4, good=4)  # TPOT 0.1 s
    assert attainment(recs, Slos(2.0, 0.35)) == 1.0
    assert attainment(recs, Slos(2.0, 0.05)) == 0.0


def test_scaled_slos():
    recs = records(4, good=2)  # the others' TTFT is 5 s
    assert attainment(recs, Slos(2.0, 0.35).scaled(3.0)) == 1.0


def test_drain_covers_the_slowest_request_that_could_still_meet_them():
    assert Slos(2.0, 0.35).drain_s(101, margin_s=0.0) == pytest.approx(2.0 + 0.35 * 100)


def test_bad_slos_and_empty_runs():
    with pytest.raises(ValueError, match="SLOs must be > 0"):
        Slos(0.0, 0.35)
    with pytest.raises(ValueError, match="no requests"):
        attainment([], Slos())
