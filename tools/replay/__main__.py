"""Open-loop trace replay against a running Triton server (gRPC streaming, or HTTP SSE).

    OMP_WAIT_POLICY=PASSIVE python -m tools.replay [--url localhost:8001] [--metrics-url URL] \\
        [--trace ../shared/data/traces/azure_llm_code_2023.csv --window-start S --window S --rate-scale R ...] \\
        [--synthetic poisson|gamma|step --rate R ...] [--out run.json]

Requests are sent when the trace says, whatever the server is doing (open loop); each is a real prompt cut
from the corpus to its token length, with max_tokens = min_length = its output length. Before the window
starts it measures the unloaded TTFT (a few requests one at a time) for the default SLO; while it runs it
samples the server's metrics for the timeline. At the end of the window it stops sending, waits up to
--drain-s for requests in flight, cancels the rest (counted as unfinished) and prints the vLLM-style summary.
See docs/replay.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.replay import metrics as rm
from tools.replay.prompts import PromptSource, load_tokenizer
from tools.replay.runner import replay
from tools.replay.tables import format_summary
from tools.replay.workload import add_workload_args, build_workload, plan, probe_request


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="localhost:8001", help="gRPC (or, with --protocol http, HTTP) host:port")
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="'' to skip the timeline")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drain-s", type=float, default=60.0, help="after the window: wait this long, then cancel")
    ap.add_argument("--probes", type=int, default=5, help="unloaded TTFT probes before the window (0: none)")
    ap.add_argument("--ttft-slo-ms", type=float, help="default: --slo-multiple x the unloaded median TTFT")
    ap.add_argument("--slo-multiple", type=float, default=5.0)
    ap.add_argument("--tpot-slo-ms", type=float)
    ap.add_argument("--out", help="write records, timeline and summary as JSON here")
    ap.add_argument("--no-progress", action="store_true")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    if args.probes == 0 and args.ttft_slo_ms is None:
        ap.error("--probes 0 needs --ttft-slo-ms")
    reqs, window_s, described = build_workload(args)
    print(f"[replay] {described}", flush=True)
    prompts = PromptSource(load_tokenizer(args.fragment_dir), args.corpus)
    planned = plan(reqs, prompts)
    result = replay(
        planned,
        args.protocol,
        args.url,
        args.metrics_url or None,
        window_s,
        args.drain_s,
        not args.no_progress,
        probe_request(planned, prompts),
        args.probes,
        args.model,
    )
    slo = rm.Slo(
        args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else rm.default_ttft_slo(result.unloaded_ttft_s, args.slo_multiple),
        args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None,
    )
    summary = rm.summarize(result.records, slo)
    print(format_summary(summary, result.unloaded_ttft_s))
    print(
        f"[replay] client send lag max {result.max_send_lag_s * 1e3:.0f} ms; metrics scrapes missed {result.metrics_errors}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"workload": described, "summary": summary.as_dict(), **result.to_json()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
