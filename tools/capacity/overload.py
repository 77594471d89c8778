"""Overload: every policy probed at a multiple of `full`'s own capacity on each seed (issue 12: at x1.25 of
full precision's capacity, SLO violations cut by at least 95% and P95 TTFT at least 4x lower).

The plan runs these probes after a seed's searches, back to back, with the same requests; each is stored like
any other probe (it is evidence about its policy's capacity too) and marked with the multiple it was run at
(`overload_of_full` in its probe block), so the report finds the pairs without recomputing the rate."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from tools.capacity import store
from tools.capacity.analysis import REFERENCE, probe_numbers
from tools.capacity.search import round_rate
from tools.capacity.stats import Interval, mean_interval

DEFAULT_FACTOR = 1.25
TARGET_CUT, TARGET_TTFT_X = 0.95, 4.0  # violations cut by >= 95%, P95 TTFT >= 4x lower
MARK = "overload_of_full"


def overload_rate(full_capacity: float, factor: float) -> float:
    return round_rate(full_capacity * factor)


@dataclass(frozen=True)
class OverloadPair:
    seed: int
    rate: float
    full: dict  # probe_numbers of full's probe
    other: dict  # and of the other policy's, at the same rate and seed

    @property
    def violations(self) -> tuple[float, float]:
        """Share of requests missing an SLO (rejected and unfinished ones included), full then the other."""
        return 1 - self.full["attainment"], 1 - self.other["attainment"]

    @property
    def cut(self) -> float | None:
        """1 - the other's violations / full's; None where full met every SLO (nothing to cut)."""
        vf, vo = self.violations
        return 1 - vo / vf if vf > 0 else None

    @property
    def ttft_x(self) -> float | None:
        """full's P95 TTFT / the other's."""
        f, o = self.full["ttft_p95"], self.other["ttft_p95"]
        return f / o if o and not math.isnan(o) and not math.isnan(f) else None


def pairs(
    root: Path, traffic: str, pool: int, quality: dict[int, float] | None
) -> dict[tuple[float, str], list[OverloadPair]]:
    """(factor, policy) -> one pair per seed that has both full's and this policy's probe at that factor."""
    by: dict[tuple[float, int], dict[str, Path]] = defaultdict(dict)
    for path in store.stored(root):
        p = store.load_probe(path)
        if p["traffic"] == traffic and p["pool"] == pool and MARK in p:
            by[(p[MARK], p["seed"])][p["policy"]] = path
    out: dict[tuple[float, str], list[OverloadPair]] = defaultdict(list)
    for (factor, seed), paths in sorted(by.items()):
        if REFERENCE not in paths:
            continue
        full = probe_numbers(paths[REFERENCE], quality)
        for policy, path in paths.items():
            if policy != REFERENCE:
                out[(factor, policy)].append(OverloadPair(seed, full["rate"], full, probe_numbers(path, quality)))
    return dict(out)


def summary(found: list[OverloadPair]) -> dict[str, Interval | None]:
    """Mean and 95% interval over seeds of each figure; the cut over the seeds where full missed anything."""

    def iv(values, share=False):
        values = [v for v in values if v is not None]
        if not values:
            return None
        i = mean_interval(values)
        if share and i.lo is not None:  # a share's t interval can cross 0 or 1; the share cannot
            i = replace(i, lo=max(0.0, i.lo), hi=min(1.0, i.hi))
        return i

    return {
        "violations_full": iv([p.violations[0] for p in found], True),
        "violations_other": iv([p.violations[1] for p in found], True),
        "cut": iv([p.cut for p in found], True),
        "ttft_p95_full": iv([p.full["ttft_p95"] for p in found]),
        "ttft_p95_other": iv([p.other["ttft_p95"] for p in found]),
        "ttft_x": iv([p.ttft_x for p in found]),
    }


def meets_targets(s: dict[str, Interval | None]) -> tuple[bool, bool]:
    """(violations cut by >= 95%, P95 TTFT >= 4x lower), each judged on its mean over seeds."""
    return (
        s["cut"] is not None and s["cut"].mean >= TARGET_CUT,
        s["ttft_x"] is not None and s["ttft_x"].mean >= TARGET_TTFT_X,
    )
