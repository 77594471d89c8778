"""The saturation sweep: one server per policy replays the window at each rate scale, lowest first, and the
highest rate scale each policy sustains within the SLO goes into sweep.md, sweep.json and sweep.png."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tools.replay import metrics as rm
from tools.replay import plots, tables
from tools.replay.paths import REPO_ROOT, shown
from tools.replay.provenance import code_version, now_utc
from tools.replay.result import ReplayResult, save_raw
from tools.replay.runner import replay
from tools.replay.servers import DYNAMIC, Server, slug, wait_idle
from tools.replay.settings import slo_of
from tools.replay.workload import build_workload, plan, probe_request


def sweep(args, out: Path, prompts) -> None:
    """One server per policy replays the window at each rate scale, lowest first (its probes before the first);
    judged, like the comparison, by one SLO from all policies' probes pooled."""
    rates = sorted(float(x) for x in args.sweep.split(","))
    version = code_version()  # the code the sweep runs, before the runs (not whatever is checked out after)
    runs: list[tuple[str, float, ReplayResult]] = []
    offered: dict[float, float] = {}
    (out / "raw_sweep").mkdir(parents=True, exist_ok=True)
    for policy in args.policy_list:
        with Server(policy, args.params, REPO_ROOT / "build" / "replay" / args.name) as h:
            for i, rate in enumerate(rates):
                reqs, window_s, _ = build_workload(args, rate_scale=rate)
                planned = plan(reqs, prompts)
                offered[rate] = len(planned) / window_s
                if i:
                    wait_idle(h.metrics_url, policy in DYNAMIC)
                res = replay(
                    planned,
                    "grpc",
                    h.grpc_url,
                    h.metrics_url,
                    window_s,
                    args.drain_s,
                    not args.no_progress,
                    probe_request(planned, prompts),
                    0 if i or args.slo_s is not None else args.probes,
                )
                runs.append((policy, rate, res))
                save_raw(out / "raw_sweep" / f"{slug(policy)}_x{rate:g}.json", policy, res)
                s = rm.summarize(res.records, rm.Slo(math.inf))
                print(
                    f"[sweep] {policy} x{rate:g}: {len(planned)} requests, P95 TTFT {s.ttft.p95:.2f} s, "
                    f"{s.request_throughput:.3f} req/s",
                    flush=True,
                )
    slo = slo_of(args, *(res for _, _, res in runs))
    points: dict[str, list[tuple[float, rm.Summary]]] = {}
    for policy, rate, res in runs:
        points.setdefault(policy, []).append((rate, rm.summarize(res.records, slo)))
    text, sustained = tables.sweep_table(points, offered, args.max_violation)
    plots.sweep(
        out / "sweep.png",
        {p: [(r, s.slo_violation_rate) for r, s in pts] for p, pts in points.items()},
        args.max_violation,
    )
    _, _, described = build_workload(args)
    body = [
        "```bash",
        args.command,
        "```",
        "",
        f"Workload at rate scale x{args.rate_scale:g}: {described}",
        "",
        f"TTFT SLO {slo.ttft_s:.2f} s"
        + (
            " (--ttft-slo-ms)"
            if args.slo_s is not None
            else f" ({args.slo_multiple:g}x the median unloaded TTFT of every policy's idle server before its lowest rate)"
        )
        + f". A policy sustains a rate scale when it and every lower one keep SLO violations at or below "
        f"{args.max_violation:.0%}.",
        "",
        text,
        "",
    ]
    if sustained.get("full") and sustained.get("balanced"):
        body.append(
            f"Throughput at saturation, balanced vs full: x{sustained['balanced'] / sustained['full']:.2f} "
            f"(target >= x{tables.TARGETS['saturation_ratio']:g})."
        )
    body += ["", "![sweep](sweep.png)"]
    (out / "sweep.md").write_text("\n".join(body) + "\n")
    (out / "sweep.json").write_text(
        json.dumps({"sustained": sustained, "rates": rates, "slo_s": slo.ttft_s, **version, "finished": now_utc()})
    )
    print("\n" + text + f"\n\n[sweep] {shown(out)}/sweep.md", flush=True)
