"""The report folder of a comparison, built from its raw/ results: report.md (the exact command, the run's commit,
workload, settings, SLO, table, targets, plots, sweep.md when present, a reading generated from the same data,
and notes.md when present, checked against the rest), summary.json and the PNGs."""

from __future__ import annotations

import json
from pathlib import Path

from tools.replay import metrics as rm
from tools.replay import narrative, plots, tables
from tools.replay.paths import repo_path, shown
from tools.replay.provenance import describe
from tools.replay.quality import load_quality
from tools.replay.result import load_raw
from tools.replay.servers import slug
from tools.replay.settings import slo_of


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def sweep_data(out: Path) -> dict | None:
    """The sweep's points judged by its own SLO, from raw_sweep/ and sweep.json, for the generated reading."""
    meta = _json(out / "sweep.json")
    if not meta:
        return None
    slo = rm.Slo(meta["slo_s"])
    points: dict[str, list] = {}
    for path in sorted((out / "raw_sweep").glob("*_x*.json")):
        policy, res = load_raw(path)
        points.setdefault(policy, []).append((float(path.stem.rsplit("_x", 1)[1]), rm.summarize(res.records, slo)))
    return {**meta, "points": {p: sorted(pts) for p, pts in points.items()}}


def write_report(args, out: Path, described: str, window_s) -> None:
    results = dict(load_raw(p) for p in sorted((out / "raw").glob("*.json")))
    results = {p: results[p] for p in args.policy_list if p in results} or results
    # NOTE: one SLO for every policy, from all runs' unloaded probes pooled: a single run's five probes on a
    # shared machine can be off by +-40%, which would move its violation count more than its policy does.
    slo = slo_of(args, *results.values())
    ppl_at, quality_note = load_quality(repo_path(args.quality), args.quality_order)
    rows = [tables.make_row(p, r, slo, slo_of(args, r), ppl_at) for p, r in results.items()]
    for policy, res in results.items():
        plots.timeline(out / f"timeline_{slug(policy)}.png", policy, res, slo, window_s)
    plots.ttft_cdfs(out / "ttft_cdf.png", results, slo)
    sweep = sweep_data(out)
    saturation = sweep.get("sustained") if sweep else None
    run = _json(out / "run.json")
    loads = ", ".join(f"{p} {r.load_avg[0]:.1f}->{r.load_avg[1]:.1f}" for p, r in results.items() if r.load_avg)
    command = args.command
    if args.report_only and run:
        command = run["command"] + f"\n# report rebuilt: {args.command}"
    md = [
        f"# Trace replay: {args.name}",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- run: {describe(run)}" + (f"; sweep: {describe(sweep)}" if sweep and sweep.get("commit") else ""),
        f"- workload: {described}".replace("\n", "\n  "),
        "- server settings (same for every policy): " + ", ".join(f"`{k}={v}`" for k, v in sorted(args.params.items())),
        (
            f"- TTFT SLO: {args.slo_s:.2f} s (--ttft-slo-ms) for every run"
            if args.slo_s is not None
            else f"- TTFT SLO: {slo.ttft_s:.2f} s for every run = {args.slo_multiple:g}x the median unloaded TTFT of all runs' "
            f"probes ({args.probes} requests sent one at a time to each run's idle server before its window, the "
            f"window's median prompt length); each run's own median and the violations it would have under "
            f"{args.slo_multiple:g}x that alone are in the table"
        )
        + (f"; TPOT SLO {args.tpot_slo_s * 1e3:.0f} ms" if args.tpot_slo_s else ""),
        f"- {quality_note}",
        f"- machine: 2 CPU cores shared with other work; load average (1 min) at start -> end of each run: {loads}",
        "- a rejected or unfinished request counts as an SLO violation; TTFT percentiles are over requests that got"
        " a first token, TPOT over completed ones; the INT4 count per token is the server's (`int4_layers` output)",
        "",
        tables.table(rows),
        "",
        "## Targets (issue 5)",
        "",
        tables.targets(rows, "balanced", saturation),
        "",
        "## Plots",
        "",
        "![TTFT CDF](ttft_cdf.png)",
        "",
    ]
    md += [f"![{p}](timeline_{slug(p)}.png)" for p in results]
    if (out / "sweep.md").exists():
        md += ["", "## Saturation sweep", "", (out / "sweep.md").read_text()]
    md += [
        "",
        "## Reading",
        "",
        "Generated from the data above (tools/replay/narrative.py).",
        "",
        narrative.reading(rows, results, slo, sweep),
    ]
    if (out / "notes.md").exists():  # hand-written context, kept across --report-only; its figures are checked
        notes = (out / "notes.md").read_text()
        stale = narrative.unbacked_figures(notes, "\n".join(md))
        md += ["", "## Notes", ""]
        if stale:
            md += [f"> **Stale notes**: notes.md cites {', '.join(stale)}, which this run's data do not contain.", ""]
            print(f"[compare] WARNING: notes.md cites figures not in this run's report: {', '.join(stale)}", flush=True)
        md += [notes]
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            {
                r.policy: {
                    **r.summary.as_dict(),
                    "peak_kv_blocks": r.peak_kv_blocks,
                    "weighted_ppl": r.weighted_ppl,
                    "quality_loss": r.quality_loss,
                    "unloaded_ttft_s": r.unloaded_ttft_s,
                    "own_slo_s": r.own_slo_s,
                    "own_violation_rate": r.own_violation_rate,
                }
                for r in rows
            },
            indent=1,
            default=str,
        )
    )
    print(
        f"\n{tables.table(rows)}\n\n{tables.targets(rows, 'balanced', saturation)}\n"
        f"\n[compare] report: {shown(out)}/report.md",
        flush=True,
    )
