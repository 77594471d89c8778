"""Bisection of one policy's capacity for one seed: the highest rate scale whose probe attains the SLOs.

A search is a small state machine so that several (one per policy) can be stepped in turn, interleaved:
`next_rate()` says which rate to probe next (None: done), `record(rate, attained)` feeds the verdict back.
It brackets first (multiplying or dividing the start by `grow` until one rate passes and one fails), then
bisects geometrically until hi / lo <= 1 + precision. The capacity is the highest rate that passed (`lo`);
attainment is assumed to fall as the rate rises (each seed replays the same requests, only faster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def round_rate(x: float) -> float:
    """Rates are kept to 4 significant digits, so a rerun asks for exactly the rates stored."""
    return float(f"{x:.4g}")


def warm_grow(precision: float) -> float:
    """The bracketing step of a search that starts at a good guess (another seed's capacity): a bracket one step
    wide is already converged, so a seed near the guess costs two probes. Just under 1 + precision so that rates
    rounded to 4 digits still close the bracket."""
    return 1 + 0.99 * precision


@dataclass
class Bisection:
    start: float
    precision: float = 0.05  # stop when hi / lo <= 1 + precision
    grow: float = 1.5  # bracketing step
    min_rate: float = 1e-3
    max_rate: float = 100.0
    max_probes: int = 12
    lo: float | None = None  # highest rate that passed
    hi: float | None = None  # lowest rate that failed
    probes: list[tuple[float, bool]] = field(default_factory=list)

    def __post_init__(self):
        if not self.min_rate <= self.start <= self.max_rate:
            raise ValueError(f"start rate {self.start} outside [{self.min_rate}, {self.max_rate}]")
        if self.precision <= 0 or self.grow <= 1 or self.max_probes < 1:
            raise ValueError("need precision > 0, grow > 1, max_probes >= 1")

    def next_rate(self) -> float | None:
        if self.done:
            return None
        if not self.probes:
            return round_rate(self.start)
        if self.lo is None:  # every probe failed: go down
            return round_rate(max(self.hi / self.grow, self.min_rate))
        if self.hi is None:  # every probe passed: go up
            return round_rate(min(self.lo * self.grow, self.max_rate))
        return round_rate(math.sqrt(self.lo * self.hi))

    def record(self, rate: float, attained: bool) -> None:
        self.probes.append((rate, attained))
        if attained:
            self.lo = rate if self.lo is None else max(self.lo, rate)
        else:
            self.hi = rate if self.hi is None else min(self.hi, rate)
        if self.lo is not None and self.hi is not None and self.lo >= self.hi:
            raise ValueError(f"attainment not monotone in the rate: passed at {self.lo:g}, failed at {self.hi:g}")

    @property
    def done(self) -> bool:
        if len(self.probes) >= self.max_probes:
            return True
        if self.lo is None:
            return self.hi is not None and self.hi <= self.min_rate
        if self.hi is None:
            return self.lo >= self.max_rate
        # rounding can make the geometric mean land on a bound: then the bracket cannot narrow further
        mid = round_rate(math.sqrt(self.lo * self.hi))
        return self.hi / self.lo <= 1 + self.precision or mid in (self.lo, self.hi)

    @property
    def capacity(self) -> float | None:
        """The highest rate that passed; None if none did."""
        return self.lo

    @property
    def status(self) -> str:
        """converged | below min | above max | out of probes | running"""
        if not self.done:
            return "running"
        if self.lo is None and self.hi is not None and self.hi <= self.min_rate:
            return "below min"
        if self.hi is None and self.lo is not None and self.lo >= self.max_rate:
            return "above max"
        if (
            self.lo is not None
            and self.hi is not None
            and (
                self.hi / self.lo <= 1 + self.precision
                or round_rate(math.sqrt(self.lo * self.hi)) in (self.lo, self.hi)
            )
        ):
            return "converged"
        return "out of probes"
