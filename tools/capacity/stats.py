"""95% intervals for capacities measured over a few seeds.

- A mean: Student's t interval over the seeds' values (mean +- t(0.975, n-1) s / sqrt n).
- A ratio of two policies' mean capacities, measured on the same seeds (paired): Fieller's interval, which
  accounts for the denominator's own uncertainty and the pairing (the covariance over seeds). It is the set
  of rho for which mean(y) - rho mean(x) is not significantly different from 0; when the denominator is not
  itself significantly above 0 that set is unbounded, and the interval is reported as such (None bounds).
The t quantile is computed here (exact CDF for integer degrees of freedom, inverted by bisection) rather than
taken from a library the project does not otherwise depend on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CONFIDENCE = 0.95


def t_cdf(t: float, df: int) -> float:
    """Student's t CDF for integer df (Abramowitz & Stegun 26.7.3 / 26.7.4: finite series in theta)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    theta = math.atan2(t, math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd: A = (2/pi)(theta + sin cos (1 + 2/3 cos^2 + ...))
        series, term = 0.0, 1.0
        if df > 1:
            series = term
            for k in range(1, (df - 3) // 2 + 1):
                term *= c * c * (2 * k) / (2 * k + 1)
                series += term
        a = 2 / math.pi * (theta + (s * c * series if df > 1 else 0.0))
    else:  # even: A = sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...)
        series, term = 1.0, 1.0
        for k in range(1, (df - 2) // 2 + 1):
            term *= c * c * (2 * k - 1) / (2 * k)
            series += term
        a = s * series
    return 0.5 + 0.5 * a  # A(t|df) = P(|T| < t) with the sign of t carried by sin(theta)


def t_quantile(p: float, df: int) -> float:
    if not 0 < p < 1:
        raise ValueError(f"quantile probability must be in (0, 1), got {p}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(slots=True, frozen=True)
class Interval:
    mean: float
    lo: float | None  # None: unbounded (or not estimable from one value)
    hi: float | None
    n: int

    def fmt(self, digits: int = 3) -> str:
        f = lambda x: "?" if x is None else f"{x:.{digits}g}"  # noqa: E731
        return f"{self.mean:.{digits}g} [{f(self.lo)}, {f(self.hi)}]"

    def as_dict(self) -> dict:
        return {"mean": self.mean, "ci95": [self.lo, self.hi], "n": self.n}


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> Interval:
    v = [float(x) for x in values]
    if not v:
        raise ValueError("no values")
    n = len(v)
    m = sum(v) / n
    if n < 2:
        return Interval(m, None, None, n)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def ratio_interval(y: list[float], x: list[float], confidence: float = CONFIDENCE) -> Interval:
    """Fieller's interval for mean(y) / mean(x), y and x paired by index (the same seeds)."""
    if len(y) != len(x) or not y:
        raise ValueError(f"ratio needs paired, non-empty samples (got {len(y)} and {len(x)})")
    n = len(y)
    my, mx = sum(y) / n, sum(x) / n
    if mx == 0:
        raise ValueError("ratio to a zero mean")
    ratio = my / mx
    if n < 2:
        return Interval(ratio, None, None, n)
    syy = sum((a - my) ** 2 for a in y) / (n - 1) / n  # variances of the means
    sxx = sum((b - mx) ** 2 for b in x) / (n - 1) / n
    sxy = sum((a - my) * (b - mx) for a, b in zip(y, x)) / (n - 1) / n
    t2 = t_quantile(0.5 + confidence / 2, n - 1) ** 2
    # (my - r mx)^2 <= t^2 (syy - 2 r sxy + r^2 sxx)  <=>  a r^2 + b r + c <= 0
    a = mx * mx - t2 * sxx
    b = -2 * (my * mx - t2 * sxy)
    c = my * my - t2 * syy
    disc = b * b - 4 * a * c
    if a <= 0 or disc < 0:  # the denominator is not significantly away from 0: unbounded
        return Interval(ratio, None, None, n)
    root = math.sqrt(disc)
    return Interval(ratio, (-b - root) / (2 * a), (-b + root) / (2 * a), n)
