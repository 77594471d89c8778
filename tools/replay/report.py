"""The report folder of a comparison, built from its raw/ results: report.md (the exact command, workload,
settings, SLO, table, targets, plots, and sweep.md and notes.md when present), summary.json and the PNGs."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tools.replay import plots, tables
from tools.replay.paths import REPO_ROOT, repo_path, shown
from tools.replay.quality import load_quality
from tools.replay.result import load_raw
from tools.replay.servers import slug
from tools.replay.settings import slo_of


def run_stamp(out: Path) -> str:
    """When the raw results were written, and the code that wrote them."""
    newest = max((p.stat().st_mtime for p in (out / "raw").glob("*.json")), default=time.time())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(newest)) + (f", commit {commit}" if commit else "")


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
    saturation = None
    if (out / "sweep.json").exists():
        saturation = json.loads((out / "sweep.json").read_text()).get("sustained")
    loads = ", ".join(f"{p} {r.load_avg[0]:.1f}->{r.load_avg[1]:.1f}" for p, r in results.items() if r.load_avg)
    command = args.command
    if args.report_only and (out / "run.json").exists():
        command = json.loads((out / "run.json").read_text())["command"] + f"\n# report rebuilt: {args.command}"
    md = [f"# Trace replay: {args.name}", "",
          "```bash", command, "```", "", f"- run: {run_stamp(out)}",
          f"- workload: {described}".replace("\n", "\n  "),
          f"- server settings (same for every policy): "
          + ", ".join(f"`{k}={v}`" for k, v in sorted(args.params.items())),
          (f"- TTFT SLO: {args.slo_s:.2f} s (--ttft-slo-ms) for every run" if args.slo_s is not None else
           f"- TTFT SLO: {slo.ttft_s:.2f} s for every run = {args.slo_multiple:g}x the median unloaded TTFT of all runs' "
           f"probes ({args.probes} requests sent one at a time to each run's idle server before its window, the "
           f"window's median prompt length); each run's own median and the violations it would have under "
           f"{args.slo_multiple:g}x that alone are in the table")
          + (f"; TPOT SLO {args.tpot_slo_s * 1e3:.0f} ms" if args.tpot_slo_s else ""),
          f"- {quality_note}",
          f"- machine: 2 CPU cores shared with other work; load average (1 min) at start -> end of each run: {loads}",
          "- a rejected or unfinished request counts as an SLO violation; TTFT percentiles are over requests that got"
          " a first token, TPOT over completed ones; the INT4 count per token is the server's (`int4_layers` output)",
          "", tables.table(rows), "",
          "## Targets (issue 5)", "", tables.targets(rows, "balanced", saturation), "",
          "## Plots", "", "![TTFT CDF](ttft_cdf.png)", ""]
    md += [f"![{p}](timeline_{slug(p)}.png)" for p in results]
    if (out / "sweep.md").exists():
        md += ["", "## Saturation sweep", "", (out / "sweep.md").read_text()]
    if (out / "notes.md").exists():  # a hand-written reading of the results, kept across --report-only
        md += ["", "## Notes", "", (out / "notes.md").read_text()]
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "summary.json").write_text(json.dumps({r.policy: {**r.summary.as_dict(), "peak_kv_blocks": r.peak_kv_blocks,
                                                             "weighted_ppl": r.weighted_ppl, "quality_loss": r.quality_loss,
                                                             "unloaded_ttft_s": r.unloaded_ttft_s,
                                                             "own_slo_s": r.own_slo_s,
                                                             "own_violation_rate": r.own_violation_rate}
                                                 for r in rows},
                                                 indent=1, default=str))
    print(f"\n{tables.table(rows)}\n\n{tables.targets(rows, 'balanced', saturation)}\n"
          f"\n[compare] report: {shown(out)}/report.md", flush=True)
