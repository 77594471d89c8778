"""What a replay sends: the workload options (a trace window and its scaling, or synthetic arrivals), and the
requests planned from them, each with a real prompt of its exact token length."""

from __future__ import annotations

import argparse
import statistics

from tools.replay.client import Planned
from tools.replay.paths import repo_path
from tools.replay.prompts import DEFAULT_CORPUS, DEFAULT_FRAGMENTS, PromptSource
from tools.replay.traces import Shaping, Synthetic, TraceRequest, parse_clip, read_trace

DEFAULT_TRACE = "../shared/data/traces/azure_llm_code_2023.csv"


def add_workload_args(ap: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Trace/synthetic and prompt options, shared by both entry points (the comparison passes its own defaults)."""
    d = {
        "window_start": 0.0,
        "window": 60.0,
        "rate_scale": 1.0,
        "time_scale": 1.0,
        "prompt_scale": 1.0,
        "output_scale": 1.0,
        "prompt_clip": "1:",
        "output_clip": "1:",
        **(defaults or {}),
    }
    g = ap.add_argument_group("workload")
    g.add_argument(
        "--trace", default=DEFAULT_TRACE, help="Azure 2023 CSV or Mooncake-style JSONL (relative: to the repo root)"
    )
    g.add_argument("--trace-format", default="auto", choices=["auto", "azure", "jsonl"])
    g.add_argument(
        "--jsonl-time-unit", type=float, default=1e-3, help="seconds per JSONL timestamp unit (Mooncake: ms)"
    )
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
        syn = Synthetic(
            args.synthetic,
            args.rate * (rate_scale or args.rate_scale),
            args.window,
            args.burstiness,
            args.burst_rate * (rate_scale or args.rate_scale),
            args.burst_s,
            args.period_s,
            args.prompt_tokens,
            args.output_tokens,
            args.length_jitter,
            args.seed,
        )
        reqs = syn.generate()
        return reqs, args.window, syn.describe() + f"; rate x{rate_scale or args.rate_scale:g}"
    shaping = Shaping(
        args.window_start,
        args.window,
        rate_scale or args.rate_scale,
        args.time_scale,
        args.prompt_scale,
        args.output_scale,
        parse_clip(args.prompt_clip),
        parse_clip(args.output_clip),
        args.seed,
    )
    reqs = shaping.apply(read_trace(repo_path(args.trace), args.trace_format, args.jsonl_time_unit))
    return reqs, shaping.duration_s, f"trace {args.trace}: " + shaping.describe()


def plan(reqs: list[TraceRequest], prompts: PromptSource) -> list[Planned]:
    out = []
    for i, r in enumerate(reqs):
        text, n = prompts.prompt(i, r.prompt_tokens)
        out.append(Planned(i, r.arrival_s, text, n, r.output_tokens))
    return out


def probe_request(planned: list[Planned], prompts: PromptSource, output_tokens: int = 4) -> Planned:
    """The unloaded probe: the window's median prompt length, a few output tokens, text not in the window."""
    n = int(statistics.median(p.prompt_tokens for p in planned)) if planned else 128
    text, got = prompts.prompt(10**6, n)
    return Planned(-1, 0.0, text, got, output_tokens)
