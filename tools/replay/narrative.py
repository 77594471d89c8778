"""The report's reading of a comparison, written from the same data as its tables so that it cannot describe
another run; and the check that keeps a hand-written notes.md honest: every figure it cites must appear in the
generated part of the report (a stale note, e.g. an SLO from an earlier run, is flagged in the report itself)."""

from __future__ import annotations

import math
import re

from tools.replay import metrics as rm
from tools.replay.tables import TARGETS, PolicyRow

STATIC_INT4 = re.compile(r"^int4(:\d+)?$")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _peak(samples: list[dict], key: str) -> float:
    return max((s[key] for s in samples if key in s), default=math.nan)


def _count(samples: list[dict], key: str) -> int | None:
    """A counter's rise over the run (the server is fresh, but its probes ran before the first sample)."""
    seen = [s[key] for s in samples if key in s]
    return int(seen[-1] - seen[0]) if seen else None


def _spans(times: list[float], gap: float = 5.0) -> str:
    """Arrival times grouped into runs no more than `gap` seconds apart: 't = 27-31 s, 137-138 s'."""
    groups: list[list[float]] = []
    for t in sorted(times):
        if groups and t - groups[-1][-1] <= gap:
            groups[-1].append(t)
        else:
            groups.append([t])
    return ", ".join(f"{g[0]:.0f}" if round(g[0]) == round(g[-1]) else f"{g[0]:.0f}-{g[-1]:.0f}" for g in groups)


def _misses(result, slo: rm.Slo) -> list:
    return [r for r in result.records if not slo.met(r)]


def _n(k: float, noun: str) -> str:
    return f"{k:.0f} {noun}" + ("" if round(k) == 1 else "s")


def _policy_line(row: PolicyRow, result, slo: rm.Slo, full: PolicyRow | None, int4: PolicyRow | None) -> str:
    s, misses, samples = row.summary, _misses(result, slo), result.samples
    text = (
        f"**{row.policy}**: {len(misses)} of {s.requests} requests miss the {slo.ttft_s:.2f} s TTFT SLO "
        f"({s.slo_violation_rate:.1%}); P95 TTFT {s.ttft.p95:.2f} s"
    )
    if full is not None and row is not full and s.ttft.p95 > 0:
        text += f", {full.summary.ttft.p95 / s.ttft.p95:.2f}x lower than full's"
    kv_used, kv_max = _peak(samples, "kv_used"), _peak(samples, "kv_blocks")
    if not math.isnan(kv_used):
        waiting, pre = _peak(samples, "waiting"), _count(samples, "preemptions")
        text += (
            f"; at most {kv_used:.0f} of {kv_max:.0f} KV blocks in use, "
            + (f"up to {_n(waiting, 'request')} waiting" if waiting else "no request waiting")
            + (f", {_n(pre, 'preemption')}" if pre is not None else "")
        )
    if row.policy != "full" and row.base_kv_blocks and not math.isnan(row.base_kv_blocks):
        text += f"; KV capacity up to x{row.peak_kv_blocks / row.base_kv_blocks:.1f} of full's"
    if row.policy != "full" and not STATIC_INT4.match(row.policy):
        peak_int4, swaps = _peak(samples, "int4_layers"), _count(samples, "swaps_down")
        if not math.isnan(peak_int4):
            text += f", up to {_n(peak_int4, 'INT4 layer')} at once" + (f" ({_n(swaps, 'swap')} down)" if swaps else "")
    if misses:
        got = [rm.ttft(r) for r in misses if rm.ttft(r) is not None]
        text += (
            f"; the misses arrived at t = {_spans([r.arrival_s for r in misses])} s"
            + (f" (TTFT {min(got):.2f}-{max(got):.2f} s)" if got else "")
            + (f", {len(misses) - len(got)} without a first token" if len(got) < len(misses) else "")
        )
    if row.policy != "full":
        text += f"; {s.full_precision_share:.1%} of its tokens at full precision"
        if not math.isnan(row.quality_loss):
            text += f", perplexity {row.quality_loss:+.2%} weighted by each token's INT4 layers"
            if int4 is not None and row is not int4 and not math.isnan(int4.quality_loss):
                text += f" (static int4: {int4.quality_loss:+.2%})"
    return text + "."


def reading(rows: list[PolicyRow], results: dict, slo: rm.Slo, sweep: dict | None = None) -> str:
    """Bullets for report.md, every figure computed here from the rows and raw results the tables come from.

    `sweep`, when the run has one: {"slo_s", "sustained": {policy: rate}, "points": {policy: [(rate, Summary)]}}."""
    by = {r.policy: r for r in rows}
    full, int4 = by.get("full"), by.get("int4")
    lines = [f"- {_policy_line(row, results[row.policy], slo, full, int4)}" for row in rows]
    if full is not None and "balanced" in by and by["balanced"].summary.ttft.p95 > 0:
        ratio = full.summary.ttft.p95 / by["balanced"].summary.ttft.p95
        lines.append(
            f"- P95 TTFT, balanced against full: {ratio:.2f}x against the {TARGETS['p95_ratio']:g}x target "
            f"({'met' if ratio >= TARGETS['p95_ratio'] else 'missed'}, margin {ratio - TARGETS['p95_ratio']:+.2f}x)."
        )
    if sweep:
        lines += _sweep_lines(sweep)
    return "\n".join(lines)


def _sweep_lines(sweep: dict) -> list[str]:
    if not sweep["points"]:
        return ["- Sweep: its raw results (raw_sweep/) are missing; only its table above remains."]
    lines = []
    order = [*sweep.get("sustained", {}), *sweep["points"]]
    for policy in dict.fromkeys(p for p in order if p in sweep["points"]):
        points = sweep["points"][policy]
        best = sweep["sustained"].get(policy)
        by_rate = dict(points)
        above = [(r, s) for r, s in sorted(points) if best is None or r > best]
        text = (
            f"- Sweep, **{policy}**: sustains x{best:g} ({by_rate[best].output_throughput:.1f} output tok/s there)"
            if best is not None
            else f"- Sweep, **{policy}**: sustains no rate tried"
        )
        if above:
            r, s = above[0]
            missed = round(s.slo_violation_rate * s.requests)
            text += f"; at x{r:g} {missed} of {s.requests} requests miss ({s.slo_violation_rate:.0%})"
        lines.append(text + f" (SLO {sweep['slo_s']:.2f} s).")
    sus = sweep["sustained"]
    if sus.get("full") and sus.get("balanced"):
        rates = sorted({r for pts in sweep["points"].values() for r, _ in pts})
        lines.append(
            f"- Throughput at saturation, balanced against full: x{sus['balanced'] / sus['full']:.2f} on the "
            f"grid {', '.join(f'x{r:g}' for r in rates)} (target x{TARGETS['saturation_ratio']:g}); each "
            f"policy's true crossing lies between its sustained grid point and the next, so this is a grid "
            f"reading."
        )
    return lines


def figures(text: str) -> set[str]:
    """The numbers a text cites, normalised (12.50 -> 12.5, 32.0 -> 32)."""
    out = set()
    for m in _NUMBER.findall(text):
        out.add(m.rstrip("0").rstrip(".") if "." in m else m)
    return out


def unbacked_figures(notes: str, generated: str) -> list[str]:
    """Figures notes.md cites that the generated report does not contain: the sign of a stale note.
    (Number by number, so it catches a changed SLO or count, not a reworded claim around the same numbers.)"""
    have = figures(generated)
    return sorted(figures(notes) - have, key=lambda x: float(x))
