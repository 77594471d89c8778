"""PNGs of a capacity measurement: attainment against rate per policy, the regime map (capacity ratio to full
against the KV pool size), the frontier (capacity against time-weighted quality loss) and attainment against
quality loss where several policies were probed at the same rate."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from tools.capacity.slo import TARGET_ATTAINMENT  # noqa: E402


def _err(interval):
    """(mean, [[below], [above]]) for errorbar; an unbounded side is drawn as no bar."""
    m = interval.mean
    return m, [[m - interval.lo if interval.lo is not None else 0], [interval.hi - m if interval.hi is not None else 0]]


def attainment(path: Path, title: str, results: dict) -> None:
    """Every probe: attainment against rate scale, one colour per policy, one marker per seed."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    markers = "os^vD<>"
    for i, (policy, res) in enumerate(results.items()):
        colour = f"C{i}"
        for j, s in enumerate(res.seeds):
            pts = sorted((p["rate"], p["attainment"]) for p in s.probes)
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                marker=markers[j % len(markers)],
                color=colour,
                alpha=0.8,
                label=policy if j == 0 else None,
            )
        if res.capacity:
            ax.axvline(res.capacity.mean, color=colour, ls=":", lw=1)
    ax.axhline(TARGET_ATTAINMENT, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("rate scale (x the trace's arrival rate)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(title + " (dotted: mean capacity; markers: seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def regime_map(
    path: Path, analysis: dict, policies: list[str], pooled: dict | None = None, equal_memory: set[str] = frozenset()
) -> None:
    """Capacity ratio to full against pool size, one panel per traffic kind; `pooled` (same shape), where
    given, is drawn hollow and dashed beside it (the reading pooled over several runs). The kinds in
    `equal_memory` (every policy held one budget) come first and say so; the others are marked as history."""
    traffic = sorted({t for t, _ in analysis}, key=lambda t: (t not in equal_memory, t))
    fig, axes = plt.subplots(1, len(traffic), figsize=(6 * len(traffic), 4.2), squeeze=False)
    series = [(analysis, "", {"marker": "o"})]
    if pooled:
        series.append((pooled, ", all runs pooled", {"marker": "s", "mfc": "none", "ls": "--", "alpha": 0.6}))
    for ax, t in zip(axes[0], traffic):
        for i, policy in enumerate(p for p in policies if p != "full"):
            for cells, suffix, style in series:
                pts = [
                    (pool, cell[policy].ratio)
                    for (tt, pool), cell in sorted(cells.items())
                    if tt == t and policy in cell and cell[policy].ratio
                ]
                if not pts:
                    continue
                xs = [p for p, _ in pts]
                ys, errs = zip(*(_err(r) for _, r in pts))
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[[e[0][0] for e in errs], [e[1][0] for e in errs]],
                    capsize=3,
                    color=f"C{i + 1}",
                    label=policy + suffix,
                    **style,
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        if t in equal_memory:
            ax.set_xlabel("memory budget: the fp16 model + N KV tokens (every policy)")
            ax.set_title(f"regime map: {t}, equal memory")
        else:
            ax.set_xlabel("KV pool at full precision (tokens)")
            ax.set_title(f"regime map: {t} (unequal memory: history)")
        ax.set_ylabel("capacity / full's (95% CI)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def frontier(path: Path, title: str, results: dict) -> None:
    """Capacity as a ratio to full's on the same seeds (so policies searched on different seeds compare)
    against time-weighted perplexity loss at that capacity, each policy one point labelled with its seed count."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (policy, res) in enumerate(results.items()):
        if not res.ratio or not res.quality_loss or math.isnan(res.quality_loss.mean):
            continue
        y, yerr = _err(res.ratio)
        x, xerr = _err(res.quality_loss)
        label = f"{policy} ({res.ratio.n} seed{'s' if res.ratio.n != 1 else ''})"
        ax.errorbar(
            [100 * x],
            [y],
            xerr=[[100 * e for e in xerr[0]], [100 * e for e in xerr[1]]],
            yerr=yerr,
            marker="o",
            capsize=3,
            color=f"C{i}",
            label=label,
        )
        ax.annotate(policy, (100 * x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    _save(
        fig, ax, path, title, "time-weighted perplexity loss at capacity (%)", "capacity / full's, same seeds (95% CI)"
    )


def _static(policy: str) -> bool:
    """full, int4 and int4:N (with any +option): one precision all the run, a point on the static curve."""
    base = policy.split("+")[0]
    return base == "full" or base.startswith("int4")


def same_rate(path: Path, title: str, rows: list[tuple[int, float, dict]]) -> None:
    """Every seed and rate several policies probed back to back: attainment against the time-weighted quality
    loss they paid for it. Static policies are joined by a line (the curve a static choice moves along); a
    dynamic policy above that line serves more at the same quality."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (seed, rate, by_policy) in enumerate(rows):
        colour = f"C{i}"
        pts = {p: (100 * n["quality_loss"], 100 * n["attainment"]) for p, n in by_policy.items()}
        pts = {p: xy for p, xy in pts.items() if not math.isnan(xy[0])}
        static = sorted(xy for p, xy in pts.items() if _static(p))
        if static:
            ax.plot(*zip(*static), marker="o", color=colour, label=f"seed {seed}, x{rate:g}: static")
        dynamic = [xy for p, xy in pts.items() if not _static(p)]
        if dynamic:
            ax.plot(*zip(*dynamic), ls="", marker="*", ms=12, color=colour, label=f"seed {seed}, x{rate:g}: dynamic")
        for p, (x, y) in pts.items():
            ax.annotate(p, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=8, color=colour)
    ax.axhline(100 * TARGET_ATTAINMENT, color="k", lw=0.8, ls="--")
    _save(fig, ax, path, title, "time-weighted perplexity loss over the probe (%)", "SLO attainment (%)")


def _save(fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    """Label the axes, add the legend if anything is labelled, write the PNG and free the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
