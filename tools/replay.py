"""Open-loop trace replay against a running Triton server (gRPC streaming, or HTTP SSE).

    OMP_WAIT_POLICY=PASSIVE python tools/replay.py [--url localhost:8001] [--metrics-url URL] \
        [--trace ../shared/data/traces/azure_llm_code_2023.csv --window-start S --window S --rate-scale R ...] \
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
import asyncio
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay_metrics as rm  # noqa: E402
from replay_client import Clock, Planned, RequestRecord, make_target  # noqa: E402
from replay_prompts import DEFAULT_CORPUS, DEFAULT_FRAGMENTS, PromptSource, load_tokenizer, repo_path  # noqa: E402
from replay_sampler import MetricsSampler  # noqa: E402
from replay_traces import Shaping, Synthetic, TraceRequest, parse_clip, read_trace  # noqa: E402

DEFAULT_TRACE = "../shared/data/traces/azure_llm_code_2023.csv"


# --- workload ---------------------------------------------------------------------------------------------------
def add_workload_args(ap: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Trace/synthetic and prompt options, shared with compare_policies.py (which passes its own defaults)."""
    d = {"window_start": 0.0, "window": 60.0, "rate_scale": 1.0, "time_scale": 1.0, "prompt_scale": 1.0,
         "output_scale": 1.0, "prompt_clip": "1:", "output_clip": "1:", **(defaults or {})}
    g = ap.add_argument_group("workload")
    g.add_argument("--trace", default=DEFAULT_TRACE, help="Azure 2023 CSV or Mooncake-style JSONL (relative: to the repo root)")
    g.add_argument("--trace-format", default="auto", choices=["auto", "azure", "jsonl"])
    g.add_argument("--jsonl-time-unit", type=float, default=1e-3, help="seconds per JSONL timestamp unit (Mooncake: ms)")
    g.add_argument("--window-start", type=float, default=d["window_start"], help="seconds into the trace")
    g.add_argument("--window", type=float, default=d["window"], help="seconds of trace to replay")
    g.add_argument("--rate-scale", type=float, default=d["rate_scale"], help="thin (<1) or replicate (>1) arrivals")
    g.add_argument("--time-scale", type=float, default=d["time_scale"], help="play the window this much faster")
    g.add_argument("--prompt-scale", type=float, default=d["prompt_scale"], help="multiply prompt lengths")
    g.add_argument("--output-scale", type=float, default=d["output_scale"], help="multiply output lengths")
    g.add_argument("--prompt-clip", default=d["prompt_clip"], help="MIN:MAX prompt tokens after scaling")
    g.add_argument("--output-clip", default=d["output_clip"], help="MIN:MAX output tokens after scaling")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--synthetic", choices=["poisson", "gamma", "step"], help="synthetic arrivals instead of a trace")
    g.add_argument("--rate", type=float, default=1.0, help="synthetic: req/s (the base rate for step)")
    g.add_argument("--burstiness", type=float, default=1.0, help="synthetic gamma: shape (<1 burstier)")
    g.add_argument("--burst-rate", type=float, default=0.0, help="synthetic step: req/s during a burst")
    g.add_argument("--burst-s", type=float, default=10.0)
    g.add_argument("--period-s", type=float, default=60.0)
    g.add_argument("--prompt-tokens", type=int, default=256, help="synthetic prompt length")
    g.add_argument("--output-tokens", type=int, default=32, help="synthetic output length")
    g.add_argument("--length-jitter", type=float, default=0.0, help="synthetic: lengths uniform within +-this share")
    g.add_argument("--corpus", default=DEFAULT_CORPUS, help="text the prompts are cut from")
    g.add_argument("--fragment-dir", default=DEFAULT_FRAGMENTS, help="fragment set whose tokenizer.json cuts prompts")


def build_workload(args, rate_scale: float | None = None) -> tuple[list[TraceRequest], float, str]:
    """(requests, window duration in s, a description of the scaling to print)."""
    if args.synthetic:
        syn = Synthetic(args.synthetic, args.rate * (rate_scale or args.rate_scale), args.window, args.burstiness,
                        args.burst_rate * (rate_scale or args.rate_scale), args.burst_s, args.period_s,
                        args.prompt_tokens, args.output_tokens, args.length_jitter, args.seed)
        reqs = syn.generate()
        return reqs, args.window, syn.describe() + f"; rate x{rate_scale or args.rate_scale:g}"
    shaping = Shaping(args.window_start, args.window, rate_scale or args.rate_scale, args.time_scale,
                      args.prompt_scale, args.output_scale, parse_clip(args.prompt_clip), parse_clip(args.output_clip),
                      args.seed)
    reqs = shaping.apply(read_trace(repo_path(args.trace), args.trace_format, args.jsonl_time_unit))
    return reqs, shaping.duration_s, f"trace {args.trace}: " + shaping.describe()


def plan(reqs: list[TraceRequest], prompts: PromptSource) -> list[Planned]:
    out = []
    for i, r in enumerate(reqs):
        text, n = prompts.prompt(i, r.prompt_tokens)
        out.append(Planned(i, r.arrival_s, text, n, r.output_tokens))
    return out


# --- running ----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    samples: list[dict] = field(default_factory=list)  # the server's metrics over time
    unloaded_ttft_s: list[float] = field(default_factory=list)
    max_send_lag_s: float = 0.0  # how late the client sent anything: the open loop's own health
    metrics_errors: int = 0
    load_avg: tuple[float, float] | None = None  # the machine's 1-min load average at start and end

    def to_json(self) -> dict:
        return {"records": [asdict(r) for r in self.records], "samples": self.samples,
                "unloaded_ttft_s": self.unloaded_ttft_s, "max_send_lag_s": self.max_send_lag_s,
                "metrics_errors": self.metrics_errors, "load_avg": self.load_avg}

    @classmethod
    def from_json(cls, data: dict) -> "ReplayResult":
        return cls([RequestRecord(**r) for r in data["records"]], data["samples"], data["unloaded_ttft_s"],
                   data.get("max_send_lag_s", 0.0), data.get("metrics_errors", 0), data.get("load_avg"))


async def probe_ttft(target, prompt: Planned, n: int) -> list[float]:
    """TTFT of n requests sent one at a time (after one warm-up) to an idle server."""
    out = []
    for i in range(n + 1):
        rec = RequestRecord(-1 - i, 0.0, prompt.prompt_tokens, prompt.output_tokens)
        await target.send(prompt, rec, Clock())
        if rec.status != "ok":
            raise RuntimeError(f"unloaded probe request failed: {rec.status} {rec.error}")
        if i:
            out.append(rm.ttft(rec))
    return out


async def _replay(planned: list[Planned], target, metrics_url: str | None, window_s: float | None,
                  drain_s: float, progress: bool, probe: Planned | None, probes: int) -> ReplayResult:
    unloaded = await probe_ttft(target, probe, probes) if probe is not None and probes else []
    clock = Clock()
    records = [RequestRecord(p.index, p.arrival_s, p.prompt_tokens, p.output_tokens) for p in planned]
    stop = asyncio.Event()
    sampler = MetricsSampler(metrics_url, clock) if metrics_url else None
    sampling = asyncio.create_task(sampler.run(stop)) if sampler else None
    bar = _progress(len(planned), progress)
    tasks: list[asyncio.Task] = []
    lag = 0.0

    def finished(_task):
        bar.update(1)
        bar.set_postfix(in_flight=sum(not t.done() for t in tasks),
                        failed=sum(r.status not in ("ok", "pending") for r in records), refresh=False)

    try:
        for p, rec in zip(planned, records):
            await asyncio.sleep(max(0.0, p.arrival_s - clock.now()))
            lag = max(lag, clock.now() - p.arrival_s)
            task = asyncio.create_task(target.send(p, rec, clock))
            task.add_done_callback(finished)
            tasks.append(task)
        if window_s is not None:  # the window's idle tail is part of the run (the server may restore layers)
            await asyncio.sleep(max(0.0, window_s - clock.now()))
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=drain_s)
    finally:
        for t in tasks:
            t.cancel()  # clean stop: whatever is still running is cancelled on the server too
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        if sampling:
            await sampling
        bar.close()
    for rec in records:
        if rec.status == "pending":
            rec.status, rec.error = "unfinished", f"not done {drain_s:g} s after the window ended"
    return ReplayResult(records, sampler.samples if sampler else [], unloaded, lag, sampler.errors if sampler else 0)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def replay(planned: list[Planned], protocol: str, url: str, metrics_url: str | None, window_s: float | None,
           drain_s: float = 60.0, progress: bool = True, probe: Planned | None = None, probes: int = 5,
           model: str = "smollm2") -> ReplayResult:
    async def go():
        target = make_target(protocol, url, model)
        try:
            return await _replay(planned, target, metrics_url, window_s, drain_s, progress, probe, probes)
        finally:
            await target.close()

    return asyncio.run(go())


def probe_request(planned: list[Planned], prompts: PromptSource, output_tokens: int = 4) -> Planned:
    """The unloaded probe: the window's median prompt length, a few output tokens, text not in the window."""
    n = int(statistics.median(p.prompt_tokens for p in planned)) if planned else 128
    text, got = prompts.prompt(10**6, n)
    return Planned(-1, 0.0, text, got, output_tokens)


# --- reporting --------------------------------------------------------------------------------------------------
def format_summary(s: rm.Summary, unloaded: list[float] | None = None) -> str:
    ms = lambda x: f"{x * 1e3:10.1f}"  # noqa: E731
    lines = [f"{'requests (completed/rejected/failed)':<40}{s.requests} ({s.completed}/{s.rejected}/{s.failed})",
             f"{'duration (s)':<40}{s.duration_s:.1f}",
             f"{'request throughput (req/s)':<40}{s.request_throughput:.3f}",
             f"{'output token throughput (tok/s)':<40}{s.output_throughput:.2f}",
             f"{'total token throughput (tok/s)':<40}{s.total_token_throughput:.2f}",
             f"{'goodput (req/s)':<40}{s.goodput:.3f}"]
    if unloaded:
        lines.append(f"{'unloaded median TTFT (ms)':<40}{statistics.median(unloaded) * 1e3:.1f}")
    lines.append(f"{'TTFT SLO (ms)':<40}{s.slo.ttft_s * 1e3:.1f}"
                 + (f"   TPOT SLO (ms) {s.slo.tpot_s * 1e3:.1f}" if s.slo.tpot_s else ""))
    lines.append(f"{'SLO violation rate':<40}{s.slo_violation_rate:.1%}")
    lines.append(f"{'':<12}{'mean':>10}{'P50':>10}{'P95':>10}{'P99':>10}   (ms)")
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)):
        lines.append(f"{name:<12}{ms(d.mean)}{ms(d.p50)}{ms(d.p95)}{ms(d.p99)}")
    lines.append(f"{'INT4 layers per generated token (mean)':<40}{s.mean_int4_layers:.2f}; "
                 f"tokens at full precision {s.full_precision_share:.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    result = replay(planned, args.protocol, args.url, args.metrics_url or None, window_s, args.drain_s,
                    not args.no_progress, probe_request(planned, prompts), args.probes, args.model)
    slo = rm.Slo(args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else rm.default_ttft_slo(result.unloaded_ttft_s, args.slo_multiple),
                 args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None)
    summary = rm.summarize(result.records, slo)
    print(format_summary(summary, result.unloaded_ttft_s))
    print(f"[replay] client send lag max {result.max_send_lag_s * 1e3:.0f} ms; metrics scrapes missed {result.metrics_errors}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"workload": described, "summary": summary.as_dict(), **result.to_json()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
