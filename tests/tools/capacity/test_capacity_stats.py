"""95% intervals (tools/capacity/stats.py): the t quantile against table values, the t interval and Fieller's
ratio interval against hand calculations."""

import math

import pytest

from tools.capacity.stats import mean_interval, ratio_interval, t_cdf, t_quantile


@pytest.mark.parametrize("df,q", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (30, 2.042)])
def test_t_quantile_matches_the_table(df, q):
    assert t_quantile(0.975, df) == pytest.approx(q, abs=1e-3)


def test_t_cdf_is_symmetric_and_half_at_zero():
    for df in (1, 2, 7):
        assert t_cdf(0.0, df) == pytest.approx(0.5)
        assert t_cdf(1.3, df) + t_cdf(-1.3, df) == pytest.approx(1.0)


def test_bad_degrees_of_freedom():
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)


def test_mean_interval_by_hand():
    # mean 2, sd 1 (values 1, 2, 3), n 3: half width 4.303 / sqrt 3
    iv = mean_interval([1.0, 2.0, 3.0])
    half = 4.302652729749464 / math.sqrt(3)
    assert iv.mean == 2.0 and iv.lo == pytest.approx(2 - half) and iv.hi == pytest.approx(2 + half)


def test_one_value_has_no_interval():
    iv = mean_interval([0.4])
    assert iv.mean == 0.4 and iv.lo is None and iv.hi is None


def test_ratio_of_exactly_proportional_pairs_is_exact():
    iv = ratio_interval([2.0, 2.2, 1.8], [1.0, 1.1, 0.9])
    assert iv.mean == pytest.approx(2.0) and iv.lo == pytest.approx(2.0) and iv.hi == pytest.approx(2.0)


def test_fieller_by_hand():
    y, x = [2.0, 2.5, 1.9], [1.0, 1.2, 0.8]
    iv = ratio_interval(y, x)
    # the bounds are where (my - r mx)^2 = t^2 var(my - r mx): check that equation at both roots
    n, my, mx = 3, sum(y) / 3, sum(x) / 3
    t2 = t_quantile(0.975, 2) ** 2
    for r in (iv.lo, iv.hi):
        d = [a - r * b for a, b in zip(y, x)]
        md = sum(d) / n
        var = sum((v - md) ** 2 for v in d) / (n - 1) / n
        assert (my - r * mx) ** 2 == pytest.approx(t2 * var)
    assert iv.lo < iv.mean < iv.hi


def test_ratio_unbounded_when_the_denominator_is_noise():
    iv = ratio_interval([1.0, 1.1, 0.9], [0.01, 1.0, 2.0])
    assert iv.lo is None and iv.hi is None


def test_ratio_needs_pairs():
    with pytest.raises(ValueError, match="paired"):
        ratio_interval([1.0, 2.0], [1.0])
