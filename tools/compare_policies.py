"""Side-by-side trace replay of morph policies, each against a freshly started server with the same settings.

    OMP_WAIT_POLICY=PASSIVE python tools/compare_policies.py [--name default] [--policies full,int4,...] \
        [--param NAME=VALUE ...] [workload options as tools/replay.py] [--quick] [--sweep 0.5,1,2]

Writes results/replay/<name>/: report.md (the table, the issue's targets, the exact command), raw/<policy>.json
(every request's timeline and the server's metrics over time), timeline_<policy>.png and ttft_cdf.png.
With --sweep it replays the window at each rate scale per policy instead and reports the highest rate each
policy sustains within the SLO (sweep.md, sweep.png). --report-only rebuilds the report from raw/.
See docs/replay.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay  # noqa: E402
import replay_metrics as rm  # noqa: E402
import replay_plots  # noqa: E402
import replay_report  # noqa: E402
from replay_prompts import REPO_ROOT, PromptSource, load_tokenizer, repo_path  # noqa: E402
from replay_quality import DEFAULT_QUALITY, load_quality  # noqa: E402
from replay_servers import DYNAMIC, Server, slug, wait_idle  # noqa: E402

DEFAULT_POLICIES = "full,balanced,int4,int4:15,accuracy,performance"  # the key pair first, back to back
# NOTE: the server settings of the comparison, explicit (docs/replay.md says why each). The full-precision pool
# (512 tokens, 32 blocks) holds about four of the default window's requests; each swapped layer buys 16 blocks,
# so balanced's 20 layers make it x11 and int4's 30 x16. Two torch threads (both cores): with the C++ decode
# kernels and a machine near load 1, balanced sustained rate x0.08 with two threads against x0.04 with one
# (TTFT SLO 2.8 s, 50 s window); at a load average of ~4 one thread was as fast, as the second stalls at
# every barrier for a core another process holds. Every --param overrides or adds to these.
DEFAULT_PARAMS = {"max_tokens_in_paged_kv_cache": "512", "block_size": "16", "max_batch_size": "32",
                  "max_num_tokens": "256", "max_queue_size": "256", "num_threads": "2",
                  "metrics_interval_s": "0.25", "drain_timeout_s": "2"}
# The default window: seconds 2160-2310 of the Azure code trace (idle, a 50 s burst, a 50 s lull, a denser 30 s
# burst, idle), thinned to 32 requests and with lengths scaled to what this 2-core CPU serves (prompts ~100
# tokens, outputs ~30: prefill runs at ~100 tokens/s here when the machine is shared).
DEFAULT_WORKLOAD = {"window_start": 2160.0, "window": 150.0, "rate_scale": 0.04, "prompt_scale": 0.04,
                    "prompt_clip": "16:160", "output_scale": 2.0, "output_clip": "16:64"}
QUICK_WORKLOAD = {"window_start": 180.0, "window": 20.0, "rate_scale": 0.05, "prompt_scale": 0.05,
                  "prompt_clip": "32:128", "output_scale": 1.0, "output_clip": "8:16"}
QUICK = {"policies": "full,balanced", "probes": 2, "drain_s": 30.0}


def shown(path: Path) -> str:
    """Paths printed relative to the repository when they are inside it (no machine paths in reports)."""
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def run_policy(policy: str, planned, window_s, args, log_dir: Path) -> replay.ReplayResult:
    load0 = os.getloadavg()[0]
    with Server(policy, args.params, log_dir) as h:
        res = replay.replay(planned, "grpc", h.grpc_url, h.metrics_url, window_s, args.drain_s,
                            not args.no_progress, args.probe, args.probes)
    res.load_avg = (load0, os.getloadavg()[0])
    s = rm.summarize(res.records, slo_of(args, res))
    print(f"[compare] {policy}: {s.completed}/{s.requests} completed, unloaded TTFT {rm.dist(res.unloaded_ttft_s).p50:.2f}"
          f" s, SLO {s.slo.ttft_s:.2f} s, violations {s.slo_violation_rate:.1%}, P95 TTFT {s.ttft.p95:.2f} s; "
          f"load average {load0:.1f} -> {res.load_avg[1]:.1f}", flush=True)
    return res


def run_stamp(out: Path) -> str:
    """When the raw results were written, and the code that wrote them."""
    newest = max((p.stat().st_mtime for p in (out / "raw").glob("*.json")), default=time.time())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(newest)) + (f", commit {commit}" if commit else "")


def save_raw(path: Path, policy: str, res: replay.ReplayResult) -> None:
    data = res.to_json()
    for r in data["records"]:  # milliseconds are plenty, and keep the files small
        for key in ("token_s", "chunk_s"):
            r[key] = [round(x, 4) for x in r[key]]
    data["policy"] = policy
    path.write_text(json.dumps(data))


def load_raw(path: Path) -> tuple[str, replay.ReplayResult]:
    data = json.loads(path.read_text())
    return data["policy"], replay.ReplayResult.from_json(data)


# --- the comparison ----------------------------------------------------------------------------------------------
def compare(args, out: Path, planned, window_s, described: str) -> None:
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps({"command": args.command}))  # --report-only keeps quoting it
    for policy in args.policy_list:
        res = run_policy(policy, planned, window_s, args, REPO_ROOT / "build" / "replay" / args.name)
        save_raw(raw / f"{slug(policy)}.json", policy, res)
    write_report(args, out, described, window_s)


def slo_of(args, *results) -> rm.Slo:
    """--ttft-slo-ms, or --slo-multiple x the median unloaded TTFT of the probes at the start of these runs."""
    probes = [t for res in results for t in res.unloaded_ttft_s]
    ttft = args.slo_s if args.slo_s is not None else rm.default_ttft_slo(probes, args.slo_multiple)
    return rm.Slo(ttft, args.tpot_slo_s)


def write_report(args, out: Path, described: str, window_s) -> None:
    results = dict(load_raw(p) for p in sorted((out / "raw").glob("*.json")))
    results = {p: results[p] for p in args.policy_list if p in results} or results
    # NOTE: one SLO for every policy, from all runs' unloaded probes pooled: a single run's five probes on a
    # shared machine can be off by +-40%, which would move its violation count more than its policy does.
    slo = slo_of(args, *results.values())
    ppl_at, quality_note = load_quality(repo_path(args.quality), args.quality_order)
    rows = [replay_report.make_row(p, r, slo, slo_of(args, r), ppl_at) for p, r in results.items()]
    for policy, res in results.items():
        replay_plots.timeline(out / f"timeline_{slug(policy)}.png", policy, res, slo, window_s)
    replay_plots.ttft_cdfs(out / "ttft_cdf.png", results, slo)
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
          "", replay_report.table(rows), "",
          "## Targets (issue 5)", "", replay_report.targets(rows, "balanced", saturation), "",
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
    print(f"\n{replay_report.table(rows)}\n\n{replay_report.targets(rows, 'balanced', saturation)}\n"
          f"\n[compare] report: {shown(out)}/report.md", flush=True)


# --- the saturation sweep ----------------------------------------------------------------------------------------
def sweep(args, out: Path, prompts) -> None:
    """One server per policy replays the window at each rate scale, lowest first (its probes before the first);
    judged, like the comparison, by one SLO from all policies' probes pooled."""
    rates = sorted(float(x) for x in args.sweep.split(","))
    runs: list[tuple[str, float, replay.ReplayResult]] = []
    offered: dict[float, float] = {}
    for policy in args.policy_list:
        with Server(policy, args.params, REPO_ROOT / "build" / "replay" / args.name) as h:
            for i, rate in enumerate(rates):
                reqs, window_s, _ = replay.build_workload(args, rate_scale=rate)
                planned = replay.plan(reqs, prompts)
                offered[rate] = len(planned) / window_s
                if i:
                    wait_idle(h.metrics_url, policy in DYNAMIC)
                res = replay.replay(planned, "grpc", h.grpc_url, h.metrics_url, window_s, args.drain_s,
                                    not args.no_progress, replay.probe_request(planned, prompts),
                                    0 if i or args.slo_s is not None else args.probes)
                runs.append((policy, rate, res))
                save_raw(out / "raw_sweep" / f"{slug(policy)}_x{rate:g}.json", policy, res)
                s = rm.summarize(res.records, rm.Slo(math.inf))
                print(f"[sweep] {policy} x{rate:g}: {len(planned)} requests, P95 TTFT {s.ttft.p95:.2f} s, "
                      f"{s.request_throughput:.3f} req/s", flush=True)
    slo = slo_of(args, *(res for _, _, res in runs))
    points: dict[str, list[tuple[float, rm.Summary]]] = {}
    for policy, rate, res in runs:
        points.setdefault(policy, []).append((rate, rm.summarize(res.records, slo)))
    text, sustained = replay_report.sweep_table(points, offered, args.max_violation)
    replay_plots.sweep(out / "sweep.png", {p: [(r, s.slo_violation_rate) for r, s in pts] for p, pts in points.items()},
                       args.max_violation)
    _, _, described = replay.build_workload(args)
    body = ["```bash", args.command, "```", "", f"Workload at rate scale x{args.rate_scale:g}: {described}", "",
            f"TTFT SLO {slo.ttft_s:.2f} s"
            + (" (--ttft-slo-ms)" if args.slo_s is not None else
               f" ({args.slo_multiple:g}x the median unloaded TTFT of every policy's idle server before its lowest rate)")
            + f". A policy sustains a rate scale when it and every lower one keep SLO violations at or below "
            f"{args.max_violation:.0%}.", "", text, ""]
    if sustained.get("full") and sustained.get("balanced"):
        body.append(f"Throughput at saturation, balanced vs full: x{sustained['balanced'] / sustained['full']:.2f} "
                    f"(target >= x{replay_report.TARGETS['saturation_ratio']:g}).")
    body += ["", "![sweep](sweep.png)"]
    (out / "sweep.md").write_text("\n".join(body) + "\n")
    (out / "sweep.json").write_text(json.dumps({"sustained": sustained, "rates": rates, "slo_s": slo.ttft_s}))
    print("\n" + text + f"\n\n[sweep] {shown(out)}/sweep.md", flush=True)


# --- command line -----------------------------------------------------------------------------------------------
def parse_args(argv):
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="quick" if quick else "default", help="report folder: results/replay/<name>/")
    ap.add_argument("--out-root", default="results/replay", help="relative: to the repository root")
    ap.add_argument("--policies", default=QUICK["policies"] if quick else DEFAULT_POLICIES,
                    help="comma-separated morph_policy values, run in this order (the first sets the default SLO)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="server parameter for every run (see docs/triton.md); defaults: "
                         + " ".join(f"{k}={v}" for k, v in DEFAULT_PARAMS.items()))
    ap.add_argument("--quick", action="store_true", help="a ~2 minute run (2 policies, a 25 s window) for the tests")
    ap.add_argument("--probes", type=int, default=QUICK["probes"] if quick else 5, help="unloaded TTFT probes per run")
    ap.add_argument("--drain-s", type=float, default=QUICK["drain_s"] if quick else 90.0)
    ap.add_argument("--ttft-slo-ms", type=float, help="default: --slo-multiple x the first run's unloaded median TTFT")
    ap.add_argument("--slo-multiple", type=float, default=5.0)
    ap.add_argument("--tpot-slo-ms", type=float)
    ap.add_argument("--quality", default=DEFAULT_QUALITY, help="tools/eval_quality.py's table")
    ap.add_argument("--quality-order", default="lis", help="the swap order whose perplexity column to use")
    ap.add_argument("--sweep", help="comma-separated rate scales: run the saturation sweep instead")
    ap.add_argument("--max-violation", type=float, default=0.10, help="sweep: a rate is sustained at or below this")
    ap.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from raw/")
    ap.add_argument("--no-progress", action="store_true")
    replay.add_workload_args(ap, QUICK_WORKLOAD if quick else DEFAULT_WORKLOAD)
    args = ap.parse_args(argv)
    from trtllm_backend.triton_params import parse_assignment

    args.params = {**DEFAULT_PARAMS, **dict(parse_assignment(a) for a in args.param)}
    if "morph_policy" in args.params:
        ap.error("morph_policy is set per run by --policies")
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.slo_s = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None
    args.tpot_slo_s = args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None
    args.command = shlex.join(["python", "tools/compare_policies.py", *(argv if argv is not None else sys.argv[1:])])
    return args


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from trtllm_backend.openmp_env import with_openmp_defaults

    with_openmp_defaults(os.environ)  # the servers inherit it
    args = parse_args(argv)
    out = repo_path(args.out_root) / args.name
    reqs, window_s, described = replay.build_workload(args)
    print(f"[compare] {described}\n[compare] policies: {', '.join(args.policy_list)}; server: "
          + " ".join(f"{k}={v}" for k, v in args.params.items()), flush=True)
    if args.report_only:
        write_report(args, out, described, window_s)
        return 0
    prompts = PromptSource(load_tokenizer(args.fragment_dir), args.corpus)
    if args.sweep:
        (out / "raw_sweep").mkdir(parents=True, exist_ok=True)
        sweep(args, out, prompts)
        return 0
    planned = replay.plan(reqs, prompts)
    args.probe = replay.probe_request(planned, prompts)
    compare(args, out, planned, window_s, described)
    return 0


if __name__ == "__main__":
    sys.exit(main())
