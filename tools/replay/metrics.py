"""Serving metrics from per-request timelines, with the vLLM serving benchmark's definitions.

Pure functions over records that have `send_s, first_token_s, end_s, token_s, chunk_s, int4_layers, status,
prompt_tokens` (tools.replay.client.RequestRecord, or anything shaped like it):

- TTFT  = first token - send;            E2EL = end - send
- TPOT  = (E2EL - TTFT) / (output tokens - 1), per request with more than one token
- ITL   = gaps between successive responses that carried tokens, all requests pooled
- TTFT is over every request that got a first token (also one cancelled later, at the end of the drain: leaving
  it out would hide the slowest); TPOT, ITL and E2EL are over completed requests, as in vLLM
- throughput = completed requests (tokens) / duration, duration = first send to last end
- goodput = completed requests within every SLO given / duration
- SLO violation rate = requests that did not complete, or broke an SLO, / all requests sent.
  NOTE: a rejected or unfinished request counts as a violation: dropping load must not look like meeting it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

PERCENTILES = (50, 95, 99)


def ttft(r) -> float | None:
    return None if r.first_token_s is None or r.send_s is None else r.first_token_s - r.send_s


def e2el(r) -> float | None:
    return None if r.end_s is None or r.send_s is None else r.end_s - r.send_s


def tpot(r) -> float | None:
    n = len(r.token_s)
    if r.status != "ok" or n < 2:
        return None
    return (e2el(r) - ttft(r)) / (n - 1)


def itls(r) -> list[float]:
    return [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:])]


@dataclass(slots=True)
class Dist:
    mean: float = math.nan
    std: float = math.nan
    p50: float = math.nan
    p95: float = math.nan
    p99: float = math.nan
    n: int = 0


def dist(values) -> Dist:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return Dist()
    p50, p95, p99 = np.percentile(v, PERCENTILES)
    return Dist(float(v.mean()), float(v.std()), float(p50), float(p95), float(p99), int(v.size))


@dataclass(slots=True)
class Slo:
    ttft_s: float
    tpot_s: float | None = None

    def met(self, r) -> bool:
        if r.status != "ok" or ttft(r) is None or ttft(r) > self.ttft_s:
            return False
        t = tpot(r)
        return self.tpot_s is None or t is None or t <= self.tpot_s


def default_ttft_slo(unloaded_ttfts: list[float], multiple: float = 5.0) -> float:
    """The default SLO: a multiple of the median TTFT of an unloaded server."""
    if not unloaded_ttfts:
        raise ValueError("no unloaded TTFT measurements")
    return multiple * float(np.median(unloaded_ttfts))


@dataclass(slots=True)
class Summary:
    requests: int
    completed: int
    rejected: int
    failed: int  # errors and requests still unfinished when the drain ended
    duration_s: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float
    slo_violation_rate: float
    slo: Slo
    mean_int4_layers: float  # per generated token
    full_precision_share: float  # share of generated tokens made with no INT4 layer
    output_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def duration(records) -> float:
    sends = [r.send_s for r in records if r.send_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    return max(ends) - min(sends) if sends and ends else 0.0


def summarize(records, slo: Slo) -> Summary:
    records = list(records)
    ok = [r for r in records if r.status == "ok"]
    dur = duration(records)
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    out_tokens = sum(len(r.token_s) for r in ok)
    int4 = [k for r in ok for k in r.int4_layers]
    return Summary(
        requests=len(records),
        completed=len(ok),
        rejected=sum(r.status == "rejected" for r in records),
        failed=sum(r.status not in ("ok", "rejected") for r in records),
        duration_s=dur,
        ttft=dist(ttft(r) for r in records),
        tpot=dist(tpot(r) for r in ok),
        itl=dist(x for r in ok for x in itls(r)),
        e2el=dist(e2el(r) for r in ok),
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(out_tokens + sum(r.prompt_tokens for r in ok)),
        goodput=per_s(sum(slo.met(r) for r in ok)),
        slo_violation_rate=(sum(not slo.met(r) for r in records) / len(records)) if records else math.nan,
        slo=slo,
        mean_int4_layers=float(np.mean(int4)) if int4 else math.nan,
        full_precision_share=float(np.mean([k == 0 for k in int4])) if int4 else math.nan,
        output_tokens=out_tokens,
    )


# --- quality ----------------------------------------------------------------------------------------------------
def weighted_perplexity(records, ppl_at: dict[int, float]) -> float:
    """Perplexity at each generated token's INT4-layer count, averaged over all generated tokens."""
    ks = [k for r in records if r.status == "ok" for k in r.int4_layers]
    if not ks:
        return math.nan
    missing = sorted(set(ks) - set(ppl_at))
    if missing:
        raise KeyError(f"the quality table has no perplexity for {missing} INT4 layers")
    return float(np.mean([ppl_at[k] for k in ks]))


def quality_loss(weighted_ppl: float, ppl_at: dict[int, float]) -> float:
    """Relative perplexity increase over full precision (0.05 = 5% worse)."""
    return weighted_ppl / ppl_at[0] - 1.0


# --- saturation ---------------------------------------------------------------------------------------------------
def max_sustained_rate(points: list[tuple[float, float]], max_violation: float) -> float | None:
    """Highest rate such that it and every lower rate tried kept the SLO violation rate <= max_violation;
    None if even the lowest did not. Points are (rate, violation rate)."""
    best = None
    for rate, violation in sorted(points):
        if not violation <= max_violation:  # NaN fails too
            break
        best = rate
    return best
