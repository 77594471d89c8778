"""Side-by-side trace replay of morph policies, each against a freshly started server with the same settings.

    OMP_WAIT_POLICY=PASSIVE python -m tools.replay.compare [--name default] [--policies full,int4,...] \\
        [--param NAME=VALUE ...] [workload options as python -m tools.replay] [--quick] [--sweep 0.5,1,2]

Writes results/replay/<name>/: report.md (the table, the issue's targets, the exact command), raw/<policy>.json
(every request's timeline and the server's metrics over time), timeline_<policy>.png and ttft_cdf.png.
With --sweep it replays the window at each rate scale per policy instead and reports the highest rate each
policy sustains within the SLO (sweep.md, sweep.png). --report-only rebuilds the report from raw/.
See docs/replay.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from tools.replay.comparison import compare
from tools.replay.paths import repo_path
from tools.replay.prompts import PromptSource, load_tokenizer
from tools.replay.quality import DEFAULT_QUALITY
from tools.replay.report import write_report
from tools.replay.settings import DEFAULT_PARAMS, DEFAULT_POLICIES, DEFAULT_WORKLOAD, QUICK, QUICK_WORKLOAD
from tools.replay.sweep import sweep
from tools.replay.workload import add_workload_args, build_workload, plan, probe_request
from trtllm_backend.openmp_env import with_openmp_defaults
from trtllm_backend.triton.params import parse_assignment

PROG = "python -m tools.replay.compare"


def parse_args(argv):
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="quick" if quick else "default", help="report folder: results/replay/<name>/")
    ap.add_argument("--out-root", default="results/replay", help="relative: to the repository root")
    ap.add_argument(
        "--policies",
        default=QUICK["policies"] if quick else DEFAULT_POLICIES,
        help="comma-separated morph_policy values, run in this order (the first sets the default SLO)",
    )
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="server parameter for every run (see docs/configuration.md); defaults: "
        + " ".join(f"{k}={v}" for k, v in DEFAULT_PARAMS.items()),
    )
    ap.add_argument("--quick", action="store_true", help="a ~2 minute run (2 policies, a 25 s window) for the tests")
    ap.add_argument("--probes", type=int, default=QUICK["probes"] if quick else 5, help="unloaded TTFT probes per run")
    ap.add_argument("--drain-s", type=float, default=QUICK["drain_s"] if quick else 90.0)
    ap.add_argument("--ttft-slo-ms", type=float, help="default: --slo-multiple x the first run's unloaded median TTFT")
    ap.add_argument("--slo-multiple", type=float, default=5.0)
    ap.add_argument("--tpot-slo-ms", type=float)
    ap.add_argument("--quality", default=DEFAULT_QUALITY, help="python -m tools.eval_quality's table")
    ap.add_argument("--quality-order", default="lis", help="the swap order whose perplexity column to use")
    ap.add_argument("--sweep", help="comma-separated rate scales: run the saturation sweep instead")
    ap.add_argument("--max-violation", type=float, default=0.10, help="sweep: a rate is sustained at or below this")
    ap.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from raw/")
    ap.add_argument("--no-progress", action="store_true")
    add_workload_args(ap, QUICK_WORKLOAD if quick else DEFAULT_WORKLOAD)
    args = ap.parse_args(argv)
    args.params = {**DEFAULT_PARAMS, **dict(parse_assignment(a) for a in args.param)}
    if "morph_policy" in args.params:
        ap.error("morph_policy is set per run by --policies")
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.slo_s = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None
    args.tpot_slo_s = args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None
    args.command = shlex.join([*PROG.split(), *(argv if argv is not None else sys.argv[1:])])
    return args


def main(argv=None) -> int:
    with_openmp_defaults(os.environ)  # the servers inherit it
    args = parse_args(argv)
    out = repo_path(args.out_root) / args.name
    reqs, window_s, described = build_workload(args)
    print(
        f"[compare] {described}\n[compare] policies: {', '.join(args.policy_list)}; server: "
        + " ".join(f"{k}={v}" for k, v in args.params.items()),
        flush=True,
    )
    if not args.report_only:
        prompts = PromptSource(load_tokenizer(args.fragment_dir), args.corpus)
        if args.sweep:
            sweep(args, out, prompts)
            return 0
        planned = plan(reqs, prompts)
        args.probe = probe_request(planned, prompts)
        compare(args, out, planned, window_s)
    write_report(args, out, described, window_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
