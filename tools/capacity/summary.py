"""The capacity claims in one machine-readable file: every capacity run's cells, grouped by traffic kind and KV
pool size, with the pooled reading (tools/capacity/pooled.py) wherever several runs measured the same policy
against full in a cell.

Each run folder (`python -m tools.capacity --out F`) keeps its own F/capacity.json; this gathers them into
`results/replay/capacity.json`, so a reader (or a plot, or docs/capacity.md) finds each cell's figures with the run,
commits and seeds they came from, without knowing the folders. Runs are listed in the order given: give the
newest last, and its figures are the cell's `latest`.

    python -m tools.capacity.summary results/replay/capacity results/replay/capacity_pool256_* ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.capacity.analysis import REFERENCE
from tools.capacity.pooled import interval_of, pool, read_run
from tools.capacity.report import TARGET_RATIO, TARGET_RATIO_LO
from tools.capacity.traffic import Traffic

SUMMARY_JSON = "results/replay/capacity.json"
SUMMARY_PLOT = "results/replay/capacity_regime_map.png"


def newest_ratios(summary: dict) -> dict:
    """{(traffic, pool): {policy: Interval}}: the ratio of the newest run that measured the policy (the
    current code's reading, where the runs are listed oldest first)."""
    out = {}
    for c in summary["cells"]:
        ratios = {}
        for run in c["runs"]:  # oldest first: a newer run's figure replaces an older one
            for policy, figures in run["policies"].items():
                r = figures.get("ratio_to_full")
                if policy != REFERENCE and r and r.get("mean") is not None:
                    ratios[policy] = interval_of(r)
        out[(c["traffic"], c["pool_tokens"])] = ratios
    return out


def pooled_ratios(summary: dict) -> dict:
    """{(traffic, pool): {policy: Interval}}: the pooled per-run ratio, only where two or more runs measured
    the policy."""
    return {
        (c["traffic"], c["pool_tokens"]): {p: interval_of(v["ratio_per_run"]) for p, v in c["pooled"].items()}
        for c in summary["cells"]
    }


def summarize(folders: list[Path]) -> dict:
    """{slo, cells: [{traffic, pool_tokens, runs: [...], latest, pooled}]} from the runs' capacity.json files.
    Raises ValueError when a folder has none, or when the runs did not all use the same SLOs."""
    runs = []
    for folder in folders:
        path = folder / "capacity.json"
        if not path.is_file():
            raise ValueError(
                f"{folder}: no capacity.json (run `python -m tools.capacity --report-only --out {folder}`)"
            )
        runs.append((folder, path, json.loads(path.read_text())))
    slos = {json.dumps(data.get("slo"), sort_keys=True) for _, _, data in runs}
    if len(slos) > 1:
        raise ValueError(f"the runs used different SLOs ({', '.join(sorted(slos))}): their capacities do not compare")
    cells: dict[tuple[str, int], dict] = {}
    for folder, _, data in runs:
        for cell in data.get("cells", []):
            key = (cell["traffic"], cell["pool_tokens"])
            entry = cells.setdefault(key, {"traffic": key[0], "pool_tokens": key[1], "runs": []})
            entry["runs"].append(
                {
                    "run": folder.name,
                    "report": data.get("report"),
                    "commits": data.get("commits", []),
                    "policies": cell["policies"],
                    **({"overload": cell["overload"]} if "overload" in cell else {}),
                    **({"memory_budget_bytes": cell["memory_budget_bytes"]} if "memory_budget_bytes" in cell else {}),
                }
            )
    for (traffic, pool_tokens), entry in cells.items():
        entry["latest"] = entry["runs"][-1]["run"]
        # Every policy of every run held one budget (the runs since db4ae86 record it): the cells to quote.
        entry["equal_memory"] = all("memory_budget_bytes" in r for r in entry["runs"])
        policies = {p for r in entry["runs"] for p in r["policies"] if p != REFERENCE}
        entry["pooled"] = {}
        for policy in sorted(policies):
            measured = [r for _, path, _ in runs if (r := read_run(path, traffic, pool_tokens, policy))]
            if len(measured) < 2:  # one run: its own figures are the reading
                continue
            p = pool(measured)
            entry["pooled"][policy] = {
                "runs": [r.run for r in p.runs],
                "ratio_per_run": p.per_run.as_dict(),
                "ratio_per_seed": p.per_seed.as_dict(),
                "meets_target_per_run": p.meets_target(p.per_run),
                "meets_target_per_seed": p.meets_target(p.per_seed),
            }
    return {
        "slo": json.loads(next(iter(slos))) if slos else None,
        "target": {"ratio_mean": TARGET_RATIO, "ratio_ci95_low": TARGET_RATIO_LO},
        "how_to_read": "Per cell (traffic kind, KV pool tokens): each run's figures as its own capacity.json holds "
        "them (capacity as rate scale and req/s, ratio to full with its 95% interval, quality "
        "loss, per seed; `overload`, where measured: each policy against full at a multiple of full's "
        "capacity, keyed by the multiple); `pooled`, where two or more runs measured a policy against full: the "
        "ratio with each run counted once (per_run: quote this one) and with every (run, seed) "
        "pair pooled (per_seed). Only ratios within a run compare: full's own capacity moves "
        "with the machine's speed. Each run's `report` holds every probe's commit, time and "
        "machine load. Cells with `equal_memory` come first: every policy held the same budget "
        "(`memory_budget_bytes`: the fp16 model + `pool_tokens` KV tokens); the others are history, where the "
        "baseline left a staging reserve idle that the dynamic policy turned into KV (docs/capacity.md).",
        "cells": sorted(cells.values(), key=lambda c: (not c["equal_memory"], c["traffic"], c["pool_tokens"])),
    }


def mapped(ratios: dict) -> dict:
    """What a map against pool size can show: for each traffic kind, the policies measured at two or more pools;
    a kind with no such policy yet keeps every point, so each kind measured has its panel. A thinned variant
    (`Traffic.variant`, e.g. conv-thin0.0375) is a coarser repeat of its kind and is left to its run's report."""
    pools_of: dict[tuple[str, str], int] = {}
    for (traffic, _), cell in ratios.items():
        for policy in cell:
            pools_of[(traffic, policy)] = pools_of.get((traffic, policy), 0) + 1
    lined = {t for (t, _), n in pools_of.items() if n >= 2}
    kept = {
        k: {p: iv for p, iv in cell.items() if pools_of[(k[0], p)] >= 2 or k[0] not in lined}
        for k, cell in ratios.items()
        if k[0] in lined or not Traffic.is_variant(k[0])
    }
    return {k: cell for k, cell in kept.items() if cell}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.capacity.summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "runs", nargs="+", type=Path, help="capacity run folders (each with its capacity.json), oldest first"
    )
    ap.add_argument("--json", type=Path, default=Path(SUMMARY_JSON))
    ap.add_argument(
        "--plot",
        type=Path,
        default=Path(SUMMARY_PLOT),
        help="the regime map: each cell's newest run, and the pooled ratio where runs were pooled",
    )
    args = ap.parse_args(argv)
    try:
        summary = summarize(args.runs)
    except ValueError as e:
        print(f"[summary] {e}", file=sys.stderr)
        return 2
    command = " ".join(["python -m tools.capacity.summary", *(argv if argv is not None else sys.argv[1:])])
    args.json.write_text(json.dumps({"command": command, **summary}, indent=1) + "\n")
    for c in summary["cells"]:
        pooled = "; ".join(
            f"{p} per run {v['ratio_per_run']['mean']:.2f}x (n={v['ratio_per_run']['n']})"
            for p, v in c["pooled"].items()
        )
        print(
            f"[summary] {c['traffic']} pool {c['pool_tokens']}: {len(c['runs'])} run(s), latest {c['latest']}"
            + (f"; pooled: {pooled}" if pooled else "")
        )
    from types import SimpleNamespace

    from tools.capacity.plots import regime_map  # matplotlib only here

    def as_analysis(ratios):
        return {k: {p: SimpleNamespace(ratio=iv) for p, iv in v.items()} for k, v in ratios.items()}

    # The newest run of each cell is the current code's reading; the pooled one (hollow) shows how much the
    # cell moved across the commits its runs measured.
    newest, pooled = mapped(newest_ratios(summary)), mapped(pooled_ratios(summary))
    equal = {c["traffic"] for c in summary["cells"]} - {c["traffic"] for c in summary["cells"] if not c["equal_memory"]}
    regime_map(
        args.plot,
        as_analysis(newest),
        sorted({p for v in newest.values() for p in v}),
        pooled=as_analysis(pooled),
        equal_memory=equal,
    )
    print(f"[summary] wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
