"""A burst against a deliberately small KV pool: every request arrives at once, served by the full policy and then by
the balanced one, at the same memory budget (the full engine's, passed to both).

Full can only queue; balanced may swap layers to INT4 and turn the freed bytes into KV blocks. Per policy: the queue
(peak and mean waiting), violations (of the engine's TTFT / TPOT SLOs, and of its invariants), TTFT (P50, P95), peak
KV (blocks in use, blocks in the pool), swaps and preemptions. The check is on the comparison's fairness and the
engine's health (same budget, nothing above it, every request served, no invariant broken), not on who wins.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from trtllm_backend.sampling import SamplingParams

from .harness import Outputs, close, make_engine
from .synth import prompt

POLICIES = ("full", "balanced")


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in [0, 100])."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _serve(
    fragment_dir, device: str, threads, shape, policy: str, budget: int | None, prompts, deadline: float
) -> dict:
    n = len(prompts)
    engine, load_s = make_engine(
        fragment_dir,
        device,
        threads,
        morph_policy=policy,
        max_batch_size=n,
        max_queue_size=max(256, n),
        max_tokens_in_paged_kv_cache=shape.burst_kv_tokens,
        memory_budget_bytes=budget,
    )
    try:
        cfg, s0, block_bytes = engine.config, engine.stats(), engine.pool.bytes_per_block
        outs, samples, truncated = Outputs(), [], False
        t0 = time.monotonic()
        for i, ids in enumerate(prompts):
            engine.add_request(
                prompt(ids),
                SamplingParams(max_tokens=shape.burst_output, ignore_eos=True),
                outs.callback(f"b{i}"),
                request_id=f"b{i}",
            )
        while len(outs.final) < n:
            if time.monotonic() > deadline:
                truncated = True
                engine.abort_all()
                break
            engine.step()
            samples.append(engine.stats())
        wall = time.monotonic() - t0
        end = engine.stats()
    finally:
        close(engine, device)
        del engine
    done = [o for o in outs.final.values() if o.finish_reason == "length"]
    ttft = [o.timings.first_token - o.timings.arrival for o in done]
    tpot = [
        (o.timings.finished - o.timings.first_token) / (o.num_output_tokens - 1)
        for o in done
        if o.num_output_tokens > 1
    ]
    slo_misses = sum(
        1
        for o in done
        if o.timings.first_token - o.timings.arrival > cfg.ttft_slo_s
        or (
            o.num_output_tokens > 1
            and (o.timings.finished - o.timings.first_token) / (o.num_output_tokens - 1) > cfg.tpot_slo_s
        )
    )
    return {
        "load_s": round(load_s, 2),
        "completed": len(done),
        "truncated_by_budget": truncated,
        "request_errors": outs.errors(),
        "wall_s": round(wall, 3),
        "output_tok_s": round(sum(o.num_output_tokens for o in done) / wall, 1),
        "queue_peak": max((s.waiting for s in samples), default=0),
        "queue_mean": round(statistics.fmean(s.waiting for s in samples), 2) if samples else 0,
        "slo": {"ttft_s": cfg.ttft_slo_s, "tpot_s": cfg.tpot_slo_s},
        "slo_violations": slo_misses,
        "invariant_violations": end.invariant_violations,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "tpot_p95_s": percentile(tpot, 95),
        "kv_blocks_start": s0.kv_blocks_total,
        "kv_blocks_used_peak": max((s.kv_blocks_used for s in samples), default=0),
        "kv_blocks_total_peak": max((s.kv_blocks_total for s in samples), default=0),
        "kv_bytes_per_block": block_bytes,
        "int4_layers_peak": max((s.int4_layers for s in samples), default=0),
        "swaps_down": end.swaps_down,
        "swaps_up": end.swaps_up,
        "preemptions": end.preemptions,
        "memory_budget_bytes": end.memory_budget_bytes,
        "memory_used_peak_bytes": max((s.memory_used_bytes for s in samples), default=0),
    }


def run(fragment_dir, device: str, threads: int | None, shape, deadline: float, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(
        2, shape.config.vocab_size, (shape.burst_requests, shape.burst_prompt), generator=gen
    ).tolist()
    out = {
        "requests": shape.burst_requests,
        "prompt_tokens": shape.burst_prompt,
        "output_tokens": shape.burst_output,
        "kv_pool_tokens": shape.burst_kv_tokens,
    }
    budget = None
    for i, policy in enumerate(POLICIES):
        # each policy gets its share of the time left: the first may not starve the second
        share = time.monotonic() + (deadline - time.monotonic()) / (len(POLICIES) - i)
        out[policy] = _serve(fragment_dir, device, threads, shape, policy, budget, prompts, share)
        budget = budget or out[policy]["memory_budget_bytes"]
        print(
            f"[gpu_check] burst {policy}: queue peak {out[policy]['queue_peak']}, P95 TTFT "
            f"{out[policy]['ttft_p95_s']} s, peak KV {out[policy]['kv_blocks_used_peak']}/"
            f"{out[policy]['kv_blocks_total_peak']} blocks, {out[policy]['swaps_down']} swaps down",
            flush=True,
        )
    runs = [out[p] for p in POLICIES]
    out["memory_budget_bytes"] = budget
    out["checks"] = {
        "same_memory_budget": len({r["memory_budget_bytes"] for r in runs}) == 1,
        "within_budget": all(r["memory_used_peak_bytes"] <= r["memory_budget_bytes"] for r in runs),
        "all_served": all(r["completed"] == shape.burst_requests and not r["truncated_by_budget"] for r in runs),
        "no_request_errors": not any(r["request_errors"] for r in runs),
        "no_invariant_violations": all(r["invariant_violations"] == 0 for r in runs),
    }
    full, balanced = out["full"], out["balanced"]
    out["balanced_over_full"] = {
        "ttft_p95": balanced["ttft_p95_s"] / full["ttft_p95_s"] if full["ttft_p95_s"] else None,
        "kv_blocks_used_peak": balanced["kv_blocks_used_peak"] / full["kv_blocks_used_peak"]
        if full["kv_blocks_used_peak"]
        else None,
    }
    out["ok"] = all(out["checks"].values())
    return out
