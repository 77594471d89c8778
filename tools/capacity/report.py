"""The capacity report: report.md (command, commits, SLOs, method, one table per traffic kind and pool, the
targets, every probe with its time and machine load), capacity.json (the figures as numbers) and the plots,
rebuilt from the stored probes alone. A notes.md in the folder (a reading of the results) is appended."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from tools.capacity import classes, overload, plots, reuse, store
from tools.capacity.analysis import REFERENCE, PolicyResult, RepeatedProbe, analyse, same_rate, within_seed_noise
from tools.capacity.slo import SENSITIVITY, TARGET_ATTAINMENT
from tools.capacity.stats import CONFIDENCE, Interval
from tools.replay import metrics as rm
from tools.replay import plots as replay_plots
from tools.replay.paths import shown
from tools.replay.quality import load_quality
from tools.replay.servers import slug

TARGET_RATIO, TARGET_RATIO_LO = 1.8, 1.5  # issue 12, balanced vs full on decode-heavy traffic where KV binds

METHOD = (
    f"Capacity = the highest rate scale at which at least {TARGET_ATTAINMENT:.0%} of the requests sent meet "
    "both SLOs (rejected, failed and unfinished requests miss), found per seed by bisection (bracket by x1.5 "
    "steps, then geometric midpoints until the failing rate is within the precision of the passing one). "
    "Each seed thins the trace window differently and replays the same requests at every rate, faster or "
    f"slower. Mean over seeds with a {CONFIDENCE:.0%} Student-t interval; the ratio to `full` is the ratio "
    "of mean capacities over the seeds both have, with Fieller's interval for paired samples (unbounded, "
    "shown as ?, when the denominator is not significantly above zero or there are fewer than 2 seeds)."
)


def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _mean(nums: list[dict], key: str) -> float:
    vals = [n[key] for n in nums if not (isinstance(n[key], float) and math.isnan(n[key]))]
    return sum(vals) / len(vals) if vals else math.nan


def _iv(iv: Interval | None, fmt) -> str:
    if iv is None:
        return "n/a"
    f = lambda x: "?" if x is None else fmt(x)  # noqa: E731
    return f"{fmt(iv.mean)} [{f(iv.lo)}, {f(iv.hi)}]"


def _pct(iv) -> str:
    """A relative loss interval in percent."""
    return _iv(iv, lambda x: f"{100 * x:+.2f}%")


def _seed_ratios(r: PolicyResult, ref: PolicyResult | None) -> str:
    """Each seed's own ratio to full (a lower bound where this policy never failed, an upper one where full did not)."""
    if not ref or r.policy == REFERENCE:
        return "-"
    full = {s.seed: s for s in ref.seeds}
    out = []
    for s in r.seeds:
        f = full.get(s.seed)
        if s.capacity and f and f.capacity:
            mark = ">=" if not s.failed_above else "<=" if not f.failed_above else ""
            out.append(f"{s.seed}: {mark}{s.capacity / f.capacity:.2f}")
    return ", ".join(out) or "n/a"


def policy_row(r: PolicyResult, ref: PolicyResult | None = None) -> str:
    seeds = ", ".join(
        f"{s.seed}: {_f(s.capacity, '{:g}')}" + (f" (<{s.failed_above:g})" if s.failed_above else " (no fail)")
        for s in r.seeds
    )
    n = r.at_capacity
    sens = (
        " / ".join(
            _f(_mean([{"v": x["sensitivity"].get(f"{f:g}", math.nan)} for x in n], "v"), "{:.0%}") for f in SENSITIVITY
        )
        if n
        else "n/a"
    )
    return (
        f"| {r.policy} | {r.capacity.fmt() if r.capacity else 'none passed'} | {r.req_s.fmt() if r.req_s else 'n/a'} "
        f"| {r.ratio.fmt() if r.ratio else 'n/a'} | {_seed_ratios(r, ref)} | {seeds} "
        f"| {_f(_mean(n, 'decode_batch_mean'), '{:.1f}')} / {_f(_mean(n, 'decode_batch_max'), '{:.0f}')} "
        f"| {_f(_mean(n, 'kv_usage_mean'), '{:.0%}')} | {_f(_mean(n, 'kv_tokens_start'), '{:.0f}')} / "
        f"{_f(_mean(n, 'kv_tokens_peak'), '{:.0f}')} "
        f"| {_f(_mean(n, 'int4_layers_mean'), '{:.1f}')} | {_f(_mean(n, 'prompt_token_share'), '{:.0%}')} "
        f"| {_f(_mean(n, 'ttft_p95'))} / {_f(_mean(n, 'tpot_p95'), '{:.3f}')} | {sens} "
        f"| {_pct(r.quality_loss)} |"
    )


HEADER = (
    "| policy | capacity (rate scale, mean [95% CI]) | req/s at capacity | ratio to full [95% CI] | ratio per seed "
    "| per seed: capacity (lowest failing) | at capacity: decode batch mean / max | KV usage (busy) "
    "| KV tokens at start / peak | INT4 layers / token | prompt share of tokens | P95 TTFT (s) / P95 TPOT (s) "
    f"| attainment at SLO x{SENSITIVITY[0]:g} / x{SENSITIVITY[1]:g} | quality loss (ppl, mean [CI]) |\n"
    + "|---" * 14
    + "|"
)


def _cell_budget(root: Path, traffic: str, pool: int) -> int | None:
    """The memory budget every policy of a cell held, from the servers' gauge in each of its probes; None where
    the probes predate the gauge. Refuses a cell whose probes held different budgets: it would not be a comparison."""
    budgets = set()
    for path in store.stored(root):
        probe, res = store.load_result(path)
        if probe["traffic"] == traffic and probe["pool"] == pool:
            budgets |= {int(x["memory_budget"]) for x in res.samples[:1] if "memory_budget" in x}
    if len(budgets) > 1:
        raise ValueError(f"{traffic}, pool {pool}: policies held different memory budgets: {sorted(budgets)}")
    return budgets.pop() if budgets else None


def meets_ratio_target(ratio: Interval) -> bool:
    """Issue 12's capacity target: mean at least TARGET_RATIO and the 95% interval's lower end at least TARGET_RATIO_LO."""
    return ratio.mean >= TARGET_RATIO and ratio.lo is not None and ratio.lo >= TARGET_RATIO_LO


def targets(cell: dict[str, PolicyResult]) -> list[str]:
    b = cell.get("balanced")
    if not b or not b.ratio:
        return ["- balanced vs full: not measured in this cell"]
    met = meets_ratio_target(b.ratio)
    return [
        f"- capacity balanced / full: {b.ratio.fmt()} (target >= {TARGET_RATIO}x with the 95% interval's lower "
        f"end >= {TARGET_RATIO_LO}x): **{'met' if met else 'missed'}**"
    ]


def same_rate_table(rows: list[tuple[int, float, dict]]) -> list[str]:
    if not rows:
        return []
    out = [
        "Same seed, same rate, back to back (every seed and rate two or more policies probed; quality loss: "
        "time-weighted perplexity loss over the probe's tokens):",
        "",
        "| seed | rate scale | offered req/s | policy | attainment | quality loss "
        "| misses: TTFT / TPOT / both / incomplete "
        "| P50 / P95 TTFT (s) | P95 TPOT (s) "
        "| decode batch mean / max | waiting (mean) | preemptions | layers swapped to INT4 | INT4 layers / token "
        "| peak KV (x full) | load 1-min |",
        "|---" * 16 + "|",
    ]
    for seed, rate, by_policy in rows:
        for policy, n in sorted(by_policy.items(), key=lambda kv: kv[0] != REFERENCE):
            out.append(
                f"| {seed} | {rate:g} | {n['offered_req_s']:.2f} | {policy} | {n['attainment']:.1%} "
                f"| {_f(100 * n['quality_loss'], '{:+.2f}%')} "
                f"| {n['misses']['ttft']} / {n['misses']['tpot']} / {n['misses']['both']} / {n['misses']['incomplete']} "
                f"| {_f(n['ttft_p50'])} / {_f(n['ttft_p95'])} | {_f(n['tpot_p95'], '{:.3f}')} "
                f"| {_f(n['decode_batch_mean'], '{:.1f}')} / {_f(n['decode_batch_max'], '{:.0f}')} "
                f"| {_f(n['waiting_mean'], '{:.1f}')} | {_f(n['preemptions'], '{:.0f}')} | {_f(n['layer_swaps_down'], '{:.0f}')} "
                f"| {_f(n['int4_layers_mean'])} "
                f"| {_f(n['kv_peak_x'], 'x{:.1f}')} | {n['load_avg_1m'][0]:.1f} -> {n['load_avg_1m'][1]:.1f} |"
            )
    return out + [""]


def noise_section(rows: list[RepeatedProbe]) -> tuple[list[str], list[dict]]:
    """Markdown and JSON: the probes either side of each capacity, run again at the same seed and rate."""
    if not rows:
        return [], []
    out = [
        "Within-seed noise: the probes either side of each capacity, repeated (same seed, same rate; the "
        "capacity above comes from the search's own probe alone):",
        "",
        "| policy | seed | rate scale | attainment, search's probe then repeats | spread (max - min) | verdicts |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        out.append(
            f"| {r.policy} | {r.seed} | {r.rate:g} | {' / '.join(f'{a:.1%}' for a in r.attainments)} "
            f"| {r.spread * 100:.1f} pts | {'agree' if r.verdicts_agree else '**differ**'} "
            f"({', '.join('pass' if v else 'fail' for v in r.verdicts)}) |"
        )
    spreads = [r.spread for r in rows]
    out += [
        "",
        f"Median spread {float(np.median(spreads)) * 100:.1f} points over {len(rows)} repeated probes; "
        f"verdicts differ in {sum(not r.verdicts_agree for r in rows)} of them.",
        "",
    ]
    return out, [r.as_dict() for r in rows]


def _pc(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def overload_section(
    found: dict[tuple[float, str], list[overload.OverloadPair]], decode_heavy: bool
) -> tuple[list[str], dict]:
    """Markdown and JSON: each policy against full at a multiple of each seed's own full capacity."""
    if not found:
        return [], {}
    lines, data = [], {}
    for (factor, policy), found_pairs in sorted(found.items()):
        s = overload.summary(found_pairs)
        lines += [
            f"Overload: `{policy}` against `full` at x{factor:g} of full's capacity (each seed's own), same "
            "requests, back to back:",
            "",
            "| seed | rate scale | SLO violations full -> "
            + policy
            + " | cut | P95 TTFT (s) full -> "
            + policy
            + " | P95 TTFT lower by | P95 TPOT (s) full -> "
            + policy
            + " | preemptions full / "
            + policy
            + " | INT4 layers / token |",
            "|---" * 9 + "|",
        ]
        for p in found_pairs:
            vf, vo = p.violations
            lines.append(
                f"| {p.seed} | {p.rate:g} | {vf:.1%} -> {vo:.1%} | {_pc(p.cut)} "
                f"| {_f(p.full['ttft_p95'])} -> {_f(p.other['ttft_p95'])} | {_x(p.ttft_x)} "
                f"| {_f(p.full['tpot_p95'], '{:.3f}')} -> {_f(p.other['tpot_p95'], '{:.3f}')} "
                f"| {_f(p.full['preemptions'], '{:.0f}')} / {_f(p.other['preemptions'], '{:.0f}')} "
                f"| {_f(p.other['int4_layers_mean'])} |"
            )
        lines.append(
            f"| mean [95% CI] | | {_iv(s['violations_full'], '{:.1%}'.format)} -> "
            f"{_iv(s['violations_other'], '{:.1%}'.format)} | {_iv(s['cut'], '{:.1%}'.format)} "
            f"| {_iv(s['ttft_p95_full'], '{:.2f}'.format)} -> {_iv(s['ttft_p95_other'], '{:.2f}'.format)} "
            f"| {_iv(s['ttft_x'], '{:.2f}x'.format)} | | | |"
        )
        lines.append("")
        if decode_heavy and policy == "balanced":
            cut_ok, ttft_ok = overload.meets_targets(s)
            lines += [
                f"- violations cut at x{factor:g}: {_iv(s['cut'], '{:.1%}'.format)} (target >= "
                f"{overload.TARGET_CUT:.0%}): **{'met' if cut_ok else 'missed'}**",
                f"- P95 TTFT lower at x{factor:g}: {_iv(s['ttft_x'], '{:.2f}x'.format)} (target >= "
                f"{overload.TARGET_TTFT_X:g}x): **{'met' if ttft_ok else 'missed'}**",
                "",
            ]
        data.setdefault(f"{factor:g}", {})[policy] = {
            **{k: v.as_dict() if v else None for k, v in s.items()},
            "per_seed": [
                {
                    "seed": p.seed,
                    "rate_scale": p.rate,
                    "violations_full": p.violations[0],
                    "violations": p.violations[1],
                    "cut": p.cut,
                    "ttft_p95_full": p.full["ttft_p95"],
                    "ttft_p95": p.other["ttft_p95"],
                }
                for p in found_pairs
            ],
        }
    return lines, data


def write_report(out: Path, json_path: Path, quality_path: Path, command: str) -> None:
    quality, qnote = load_quality(quality_path)
    result = analyse(out, quality)
    probes = [store.load_probe(p) for p in store.stored(out)]
    if not probes:
        raise SystemExit(f"no stored probes under {shown(out)}/raw: nothing to report")
    commits = sorted({p["commit"] for p in probes})
    dirty = sorted({d for p in probes for d in p.get("dirty", [])})
    slo = probes[0]["slo"]
    if any(p["slo"] != slo for p in probes):
        raise SystemExit("stored probes were judged by different SLOs; rerun them (--force) or move them away")
    params = {json.dumps(p.get("server_params", {}), sort_keys=True) for p in probes}
    policies = list(dict.fromkeys(p["policy"] for p in sorted(probes, key=lambda p: p["started_utc"])))
    measured = (out / "commands.txt").read_text().splitlines() if (out / "commands.txt").exists() else []
    lines = [
        "# Capacity by search",
        "",
        "```bash",
        *(measured or ["# (measuring commands not recorded)"]),
        f"# this report: {command}",
        "```",
        "",
        f"- report built {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from {len(probes)} stored probes, run "
        f"{min(p['started_utc'] for p in probes)} to {max(p['started_utc'] for p in probes)} UTC on "
        f"{', '.join(f'commit {c}' for c in commits)}"
        + (f"; served paths differing from the commit when probes ran: {', '.join(dirty)}" if dirty else ""),
        f"- SLOs (fixed, tools/capacity/slo.py): TTFT {slo['ttft_s']:g} s, TPOT {slo['tpot_s']:g} s; a rate is served "
        f"at attainment >= {slo['target_attainment']:.0%}",
        f"- method: {METHOD}",
        f"- machine: {probes[0]['cpus']} CPUs shared with other work; 1-min load average over all probes "
        f"{min(min(p['load_avg_1m']) for p in probes):.1f}-{max(max(p['load_avg_1m']) for p in probes):.1f} "
        "(each probe's is in the probe log below)",
        "- server settings: "
        + " | ".join(", ".join(f"`{k}={v}`" for k, v in sorted(json.loads(s).items())) for s in sorted(params))
        + " (pool size per cell)",
        f"- {qnote}",
        "",
    ]
    cells = []
    for (traffic, pool), cell in sorted(result.items()):
        ordered = {p: cell[p] for p in policies if p in cell}
        budget = _cell_budget(out, traffic, pool)
        lines += [
            f"## {traffic}, memory of the full-precision model + {pool} KV tokens"
            + (f" ({budget / 2**20:.1f} MiB, every policy)" if budget else ""),
            "",
        ]
        example = next((p for p in probes if p["traffic"] == traffic and p["pool"] == pool), None)
        if example:
            lines += [f"Traffic: {example['traffic_described']}.", ""]
            lines += ["Workload at one probe (as printed by the replay):", "", "```", example["workload"], "```", ""]
        lines += [HEADER] + [policy_row(r, cell.get(REFERENCE)) for r in ordered.values()] + [""]
        if traffic.startswith("conv"):
            lines += ["Targets (issue 12, decode-heavy):", ""] + targets(cell) + [""]
        equal_load = same_rate(out, traffic, pool, quality)
        lines += same_rate_table(equal_load)
        if quality and equal_load:
            png = f"same_rate_{traffic}_pool{pool}.png"
            plots.same_rate(out / png, f"equal load: {traffic}, pool {pool}", equal_load)
            lines += [f"![attainment against quality at equal load]({png})", ""]
        over_lines, over_data = overload_section(
            overload.pairs(out, traffic, pool, quality), traffic.startswith("conv")
        )
        lines += over_lines
        reuse_lines, reuse_data = reuse.section(ordered)
        lines += reuse_lines
        class_lines, class_data = classes.section(classes.rows(out, traffic, pool, cell, quality))
        lines += class_lines
        noise_lines, noise_data = noise_section(within_seed_noise(out, traffic, pool))
        lines += noise_lines
        name = f"{traffic}_pool{pool}"
        plots.attainment(out / f"attainment_{name}.png", f"{traffic}, pool {pool}", ordered)
        lines += [f"![attainment](attainment_{name}.png)", ""]
        if quality:
            plots.frontier(out / f"frontier_{name}.png", f"frontier: {traffic}, pool {pool}", ordered)
            lines += [f"![frontier](frontier_{name}.png)", ""]
        for policy in (REFERENCE, "balanced"):  # the timelines behind the explanation: first seed, at capacity
            r = cell.get(policy)
            s = next((s for s in r.seeds if s.at_capacity), None) if r else None
            if s:
                probe, res = store.load_result(s.at_capacity)
                png = f"timeline_{name}_{slug(policy)}.png"
                replay_plots.timeline(
                    out / png,
                    f"{policy} at x{s.capacity:g} (seed {s.seed})",
                    res,
                    rm.Slo(probe["slo"]["ttft_s"], probe["slo"]["tpot_s"]),
                    probe["window_s"],
                )
                lines += [f"![{policy} timeline]({png})", ""]
        cells.append(
            {
                "traffic": traffic,
                "pool_tokens": pool,
                "memory_budget_bytes": budget,
                "policies": {
                    p: {
                        **r.as_dict(),
                        "kv_tokens_start": _mean(r.at_capacity, "kv_tokens_start"),
                        "kv_tokens_peak": _mean(r.at_capacity, "kv_tokens_peak"),
                        "prefix_reused_share": _mean(r.at_capacity, "prefix_reused_share"),
                    }
                    for p, r in ordered.items()
                },
                **({"overload": over_data} if over_data else {}),
                **({"prefix_reuse": reuse_data} if reuse_data else {}),
                **({"priority_classes": class_data} if class_data else {}),
                **({"within_seed_noise": noise_data} if noise_data else {}),
            }
        )
    pools = {pool for _, pool in result}
    if len(pools) > 1:
        equal = {c["traffic"] for c in cells if c["memory_budget_bytes"]}
        plots.regime_map(out / "regime_map.png", result, policies, equal_memory=equal)
        lines += ["## Regime map", "", "![regime map](regime_map.png)", ""]
    else:
        lines += ["## Regime map", "", f"Only pool {sorted(pools)} measured so far: no map yet.", ""]
    lines += [
        "## Probe log",
        "",
        "| traffic | pool | policy | seed | rate scale | requests | offered req/s | attainment "
        "| verdict | started (UTC) | load 1-min start -> end | wall (s) | HEAD at probe start "
        "| server's commit, started (UTC) |",
        "|---" * 14 + "|",
    ]
    for p in sorted(probes, key=lambda p: p["started_utc"]):
        lines.append(
            f"| {p['traffic']} | {p['pool']} | {p['policy']} | {p['seed']} | {p['rate']:g} | {p['requests']} "
            f"| {p['offered_req_s']:.2f} | {p['attainment']:.1%} | {'pass' if p['attained'] else 'fail'} "
            f"| {p['started_utc']} | {p['load_avg_1m'][0]:.1f} -> {p['load_avg_1m'][1]:.1f} | {p['wall_s']:.0f} "
            f"| {p['commit']}{'+dirty' if p.get('dirty') else ''} "
            f"| {p.get('server_commit', 'not recorded')}{'+dirty' if p.get('server_dirty') else ''} "
            f"{p.get('server_started_utc', '')} |"
        )
    notes = out / "notes.md"
    if notes.exists():
        lines += ["", "## Notes", "", notes.read_text().strip()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps(
            {
                "slo": slo,
                "method": METHOD,
                "commits": commits,
                "dirty_paths": dirty,
                "report": shown(out / "report.md"),
                "cells": cells,
            },
            indent=1,
            default=float,
        )
    )
    print(f"[capacity] wrote {shown(out / 'report.md')} and {shown(json_path)}", flush=True)
