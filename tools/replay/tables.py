"""The text tables: one run's summary (as vLLM's benchmark prints it) and, for report.md of a policy
comparison, the policy table, the issue's targets checked against it, and the sweep."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from tools.replay import metrics as rm

# The issue's targets: dynamic `balanced` against static `full` (and `int4` for quality).
TARGETS = {"violation_cut": 0.90, "p95_ratio": 2.5, "quality_share": 1 / 3, "saturation_ratio": 1.5}


@dataclass(slots=True)
class PolicyRow:
    policy: str
    summary: rm.Summary  # judged by the SLO shared by every run
    unloaded_ttft_s: float  # this run's own probes
    peak_kv_blocks: float
    base_kv_blocks: float
    own_slo_s: float  # from this run's probes alone
    own_violation_rate: float  # judged by that instead
    weighted_ppl: float = math.nan
    quality_loss: float = math.nan


def peak(samples: list[dict], key: str) -> float:
    return max((s[key] for s in samples if key in s), default=math.nan)


def make_row(policy: str, result, slo: rm.Slo, own: rm.Slo, ppl_at: dict[int, float] | None) -> PolicyRow:
    s = rm.summarize(result.records, slo)
    row = PolicyRow(
        policy,
        s,
        statistics.median(result.unloaded_ttft_s) if result.unloaded_ttft_s else math.nan,
        peak(result.samples, "kv_blocks"),
        peak(result.samples, "kv_capacity"),
        own.ttft_s,
        rm.summarize(result.records, own).slo_violation_rate,
    )
    if ppl_at:
        try:
            row.weighted_ppl = rm.weighted_perplexity(result.records, ppl_at)
            row.quality_loss = rm.quality_loss(row.weighted_ppl, ppl_at)
        except KeyError:
            pass  # a count the table lacks: leave n/a rather than guess
    return row


def format_summary(s: rm.Summary, unloaded: list[float] | None = None) -> str:
    ms = lambda x: f"{x * 1e3:10.1f}"  # noqa: E731
    lines = [
        f"{'requests (completed/rejected/failed)':<40}{s.requests} ({s.completed}/{s.rejected}/{s.failed})",
        f"{'duration (s)':<40}{s.duration_s:.1f}",
        f"{'request throughput (req/s)':<40}{s.request_throughput:.3f}",
        f"{'output token throughput (tok/s)':<40}{s.output_throughput:.2f}",
        f"{'total token throughput (tok/s)':<40}{s.total_token_throughput:.2f}",
        f"{'goodput (req/s)':<40}{s.goodput:.3f}",
    ]
    if unloaded:
        lines.append(f"{'unloaded median TTFT (ms)':<40}{statistics.median(unloaded) * 1e3:.1f}")
    lines.append(
        f"{'TTFT SLO (ms)':<40}{s.slo.ttft_s * 1e3:.1f}"
        + (f"   TPOT SLO (ms) {s.slo.tpot_s * 1e3:.1f}" if s.slo.tpot_s else "")
    )
    lines.append(f"{'SLO violation rate':<40}{s.slo_violation_rate:.1%}")
    lines.append(f"{'':<12}{'mean':>10}{'P50':>10}{'P95':>10}{'P99':>10}   (ms)")
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)):
        lines.append(f"{name:<12}{ms(d.mean)}{ms(d.p50)}{ms(d.p95)}{ms(d.p99)}")
    lines.append(
        f"{'INT4 layers per generated token (mean)':<40}{s.mean_int4_layers:.2f}; "
        f"tokens at full precision {s.full_precision_share:.1%}"
    )
    return "\n".join(lines)


def _f(x: float, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:{spec}}{suffix}"


def table(rows: list[PolicyRow]) -> str:
    head = (
        "| policy | SLO violations | TTFT P50 / P95 / P99 (s) | TPOT P99 (ms) | req/s | output tok/s | "
        "peak KV blocks (x full) | INT4 layers / token | quality: ppl (loss) | tokens at full precision | "
        "done / rejected / failed | own unloaded TTFT (s) | violations at own SLO |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        s = r.summary
        kv = (
            f"{_f(r.peak_kv_blocks, '.0f')} (x{_f(r.peak_kv_blocks / r.base_kv_blocks, '.1f')})"
            if r.base_kv_blocks and not math.isnan(r.base_kv_blocks)
            else _f(r.peak_kv_blocks, ".0f")
        )
        quality = "n/a" if math.isnan(r.weighted_ppl) else f"{r.weighted_ppl:.3f} ({r.quality_loss:+.2%})"
        lines.append(
            f"| {r.policy} | {_f(s.slo_violation_rate, '.1%')} | "
            f"{_f(s.ttft.p50, '.2f')} / {_f(s.ttft.p95, '.2f')} / {_f(s.ttft.p99, '.2f')} | "
            f"{_f(s.tpot.p99, '.0f', 1e3)} | {_f(s.request_throughput, '.3f')} | {_f(s.output_throughput, '.2f')} | "
            f"{kv} | {_f(s.mean_int4_layers, '.2f')} | {quality} | {_f(s.full_precision_share, '.1%')} | "
            f"{s.completed} / {s.rejected} / {s.failed} | {_f(r.unloaded_ttft_s, '.2f')} | "
            f"{_f(r.own_violation_rate, '.1%')} (SLO {r.own_slo_s:.2f} s) |"
        )
    return "\n".join(lines)


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def targets(rows: list[PolicyRow], dynamic: str = "balanced", saturation: dict | None = None) -> str:
    by = {r.policy: r for r in rows}
    full, dyn, int4 = by.get("full"), by.get(dynamic), by.get("int4")
    if full is None or dyn is None:
        return f"Targets: need both `full` and `{dynamic}` in the run."
    out = [f"| target ({dynamic} vs full) | wanted | measured | |", "|---|---|---|---|"]
    for label, vf, vd in (
        ("SLO violations cut", full.summary.slo_violation_rate, dyn.summary.slo_violation_rate),
        ("... each at its own run's SLO", full.own_violation_rate, dyn.own_violation_rate),
    ):
        cut = (1 - vd / vf) if vf > 0 else math.nan
        out.append(
            f"| {label} | >= {TARGETS['violation_cut']:.0%} | {_f(cut, '.1%')} ({vf:.1%} -> {vd:.1%}) | "
            f"{_verdict(None if math.isnan(cut) else cut >= TARGETS['violation_cut'])} |"
        )
    ratio = full.summary.ttft.p95 / dyn.summary.ttft.p95 if dyn.summary.ttft.p95 > 0 else math.nan
    out.append(
        f"| P95 TTFT lower by | >= {TARGETS['p95_ratio']:g}x | {_f(ratio, '.2f', suffix='x')} "
        f"({full.summary.ttft.p95:.2f} s -> {dyn.summary.ttft.p95:.2f} s) | "
        f"{_verdict(None if math.isnan(ratio) else ratio >= TARGETS['p95_ratio'])} |"
    )
    if int4 is not None and not math.isnan(dyn.quality_loss) and not math.isnan(int4.quality_loss):
        share = dyn.quality_loss / int4.quality_loss if int4.quality_loss > 0 else math.nan
        out.append(
            f"| quality loss vs int4's | <= {TARGETS['quality_share']:.2f} of it | {_f(share, '.2f')} "
            f"({dyn.quality_loss:+.2%} vs {int4.quality_loss:+.2%}) | "
            f"{_verdict(None if math.isnan(share) else share <= TARGETS['quality_share'])} |"
        )
    else:
        out.append("| quality loss vs int4's | <= 0.33 of it | n/a (no quality table, or no int4 run) | n/a |")
    if saturation and saturation.get("full") and saturation.get(dynamic):
        sat = saturation[dynamic] / saturation["full"]
        out.append(
            f"| throughput at saturation | >= {TARGETS['saturation_ratio']:g}x | {sat:.2f}x "
            f"(rate scale {saturation['full']:g} -> {saturation[dynamic]:g}) | "
            f"{_verdict(sat >= TARGETS['saturation_ratio'])} |"
        )
    else:
        out.append("| throughput at saturation | >= 1.5x | see the sweep (`--sweep`) | n/a |")
    return "\n".join(out)


def sweep_table(
    points: dict[str, list[tuple[float, rm.Summary]]], offered: dict[float, float], max_violation: float
) -> tuple[str, dict]:
    """Per policy and rate scale: violations (and completed req/s); then the highest sustained rate scale and
    the arrival rate it offers (the same window at every scale, so the ratio of two policies' sustained rates
    is their throughput ratio at saturation)."""
    rates = sorted({r for pts in points.values() for r, _ in pts})
    lines = [
        "| policy | "
        + " | ".join(f"x{r:g} ({offered[r]:.2f} req/s)" for r in rates)
        + " | sustained rate scale | offered req/s there | output tok/s there |",
        "|" + "|".join(["---"] * (len(rates) + 4)) + "|",
    ]
    sustained = {}
    for policy, pts in points.items():
        by_rate = dict(pts)
        best = rm.max_sustained_rate([(r, s.slo_violation_rate) for r, s in pts], max_violation)
        sustained[policy] = best
        cells = [f"{by_rate[r].slo_violation_rate:.0%}" if r in by_rate else "" for r in rates]
        there = f"{offered[best]:.3f} | {by_rate[best].output_throughput:.1f}" if best is not None else "n/a | n/a"
        label = "none" if best is None else (f">= {best:g} (the highest tried)" if best == rates[-1] else f"{best:g}")
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {label} | {there} |")
    return "\n".join(lines), sustained
