"""PNG plots of a policy comparison: one timeline per policy, TTFT CDFs, and the saturation sweep."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tools.replay import metrics as rm  # noqa: E402

BIN_S = 5.0  # arrival-rate bins


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(s["t"], s[key]) for s in samples if key in s]
    return [t for t, _ in pts], [v for _, v in pts]


def timeline(path: Path, policy: str, result, slo: rm.Slo, window_s: float | None) -> None:
    recs, samples = result.records, result.samples
    end = max([window_s or 0.0] + [r.end_s or 0.0 for r in recs] + [s["t"] for s in samples])
    fig, ax = plt.subplots(5, 1, figsize=(11, 11), sharex=True, gridspec_kw={"height_ratios": [1, 1, 1, 1.2, 1.6]})
    fig.suptitle(f"{policy}: timeline (TTFT SLO {slo.ttft_s:.2f} s)")

    bins = np.arange(0.0, end + BIN_S, BIN_S)
    counts, _ = np.histogram([r.arrival_s for r in recs], bins=bins)
    ax[0].step(bins[:-1], counts / BIN_S, where="post", color="tab:blue")
    ax[0].set_ylabel(f"arrivals\n(req/s, {BIN_S:g} s bins)")

    for key, color in (("waiting", "tab:red"), ("scheduled", "tab:green")):
        t, v = _series(samples, key)
        ax[1].plot(t, v, color=color, label=key, drawstyle="steps-post")
    ax[1].set_ylabel("requests")
    ax[1].legend(loc="upper right", fontsize=8)

    t, v = _series(samples, "int4_layers")
    ax[2].plot(t, v, color="tab:purple", drawstyle="steps-post")
    ax[2].set_ylabel("INT4 layers")
    ax[2].set_ylim(-1, max(v + [1]) + 2)

    for key, color, label in (
        ("kv_blocks", "tab:orange", "KV capacity"),
        ("kv_used", "tab:gray", "KV used"),
        ("kv_capacity", "black", "configured pool (max_tokens_in_paged_kv_cache)"),
    ):
        t, v = _series(samples, key)
        ax[3].plot(
            t, v, color=color, label=label, drawstyle="steps-post", linestyle="--" if key == "kv_capacity" else "-"
        )
    ax[3].set_ylabel("KV blocks")
    ax[3].legend(loc="upper right", fontsize=8)

    served = [r for r in recs if rm.ttft(r) is not None]
    good = [r for r in served if slo.met(r)]
    bad = [r for r in served if not slo.met(r)]
    ax[4].scatter([r.send_s for r in good], [rm.ttft(r) for r in good], s=8, color="tab:green", label="within SLO")
    ax[4].scatter([r.send_s for r in bad], [rm.ttft(r) for r in bad], s=8, color="tab:red", label="SLO violated")
    lost = [r for r in recs if rm.ttft(r) is None]
    if lost:
        top = max([rm.ttft(r) for r in served] + [slo.ttft_s]) * 1.5
        ax[4].scatter(
            [r.arrival_s for r in lost],
            [top] * len(lost),
            marker="x",
            color="black",
            label=f"no token: rejected/failed ({len(lost)})",
        )
    ax[4].axhline(slo.ttft_s, color="black", linestyle="--", linewidth=1, label="SLO")
    ax[4].set_yscale("log")
    ax[4].set_ylabel("TTFT (s)")
    ax[4].set_xlabel("time since the window started (s)")
    ax[4].legend(loc="upper right", fontsize=8)
    for a in ax:
        a.grid(alpha=0.3)
        if window_s:
            a.axvline(window_s, color="gray", linewidth=0.8, linestyle=":")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def ttft_cdfs(path: Path, results: dict, slo: rm.Slo) -> None:
    """All policies on one axis; requests that never got a token sit at +inf (the curve stops short of 1)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, result in results.items():
        recs = result.records
        v = np.sort([rm.ttft(r) for r in recs if rm.ttft(r) is not None])
        if len(v):
            ax.step(v, np.arange(1, len(v) + 1) / len(recs), where="post", label=policy)
    ax.axvline(slo.ttft_s, color="black", linestyle="--", linewidth=1, label=f"SLO {slo.ttft_s:.2f} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("TTFT CDF per policy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def sweep(path: Path, points: dict[str, list[tuple[float, float]]], max_violation: float) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, pts in points.items():
        pts = sorted(pts)
        ax.plot([r for r, _ in pts], [v * 100 if not math.isnan(v) else None for _, v in pts], marker="o", label=policy)
    ax.axhline(max_violation * 100, color="black", linestyle="--", linewidth=1, label="sustained if below")
    ax.set_xlabel("rate scale")
    ax.set_ylabel("SLO violations (%)")
    ax.set_title("Saturation sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
