"""Morphing while decoding: every layer swapped down to INT4 one at a time, then every one restored, forced
(EngineConfig.force_morph) while a batch of requests keeps decoding.

Per swap: its stage time (the fragment read and prepared off the engine thread, until the iteration that binds it)
and bind time (the rebinding and KV change on the engine thread), and the KV blocks the pool has after it. Per step:
its time. The check: every swap done, none failed, no invariant broken, and no decode step during the swaps longer
than two baseline decode steps (stalled by no more than one step). Steps that also prefill a request added to keep
the batch full are reported apart.
"""

from __future__ import annotations

import statistics
import time

import torch

from trtllm_backend.sampling import SamplingParams

from .harness import Outputs, close, make_engine
from .synth import prompt

WARMUP = 12  # iterations before the forced swaps down: the prefill, then the baseline decode steps
PROMPT = 16


def _summary(swaps: list[dict], kind: str) -> dict:
    mine = [s for s in swaps if s["kind"] == kind]
    if not mine:
        return {"count": 0}
    stage, bind = [s["stage_ms"] for s in mine], [s["bind_ms"] for s in mine]
    return {
        "count": len(mine),
        "stage_ms_median": statistics.median(stage),
        "stage_ms_max": max(stage),
        "bind_ms_median": statistics.median(bind),
        "bind_ms_max": max(bind),
        "kv_blocks_gained": sum(s["kv_blocks_after"] - s["kv_blocks_before"] for s in mine),
    }


def run(
    fragment_dir, device: str, threads: int | None, shape, deadline: float, layers: int | None = None, seed: int = 0
) -> dict:
    n = layers or shape.config.num_layers
    B = shape.swap_batch
    engine, load_s = make_engine(
        fragment_dir,
        device,
        threads,
        morph_policy="full",
        max_batch_size=B,
        max_tokens_in_paged_kv_cache=B * shape.swap_context,
        prefill_chunk_tpot_share=0.0,
        force_morph=f"down:{n}@{WARMUP},up:{n}@{WARMUP + 1}",
    )
    try:
        s0 = engine.stats()
        per_request = s0.kv_blocks_total * engine.config.block_size // B
        max_tokens = min(engine.max_model_len, per_request) - PROMPT - 1
        gen = torch.Generator().manual_seed(seed)
        outs, added, finished = Outputs(), [0], []

        def add() -> None:
            rid = f"r{added[0]}"
            added[0] += 1
            ids = torch.randint(2, shape.config.vocab_size, (PROMPT,), generator=gen).tolist()
            # add() only runs before the `finally` below deletes engine
            engine.add_request(  # noqa: F821
                prompt(ids),
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                outs.callback(rid, on_finish=finished.append),
                request_id=rid,
            )

        for _ in range(B):
            add()
        steps, swaps, seen, truncated = [], [], s0.swaps_timed, False
        before = s0
        while True:
            prefill = bool(finished) or not steps
            for _ in range(len(finished)):  # keep the batch full: a finished request is replaced
                add()
            finished.clear()
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            s = engine.stats()
            steps.append(
                {
                    "iteration": s.iterations,
                    "ms": dt * 1e3,
                    "prefill": prefill,
                    "int4_layers": s.int4_layers,
                    "kv_blocks": s.kv_blocks_total,
                }
            )
            for prepare_s, apply_s in s.timings_since(seen):
                swaps.append(
                    {
                        "kind": "down" if s.int4_layers > before.int4_layers else "up",
                        "iteration": s.iterations,
                        "int4_layers": s.int4_layers,
                        "stage_ms": prepare_s * 1e3,
                        "bind_ms": apply_s * 1e3,
                        "kv_blocks_before": before.kv_blocks_total,
                        "kv_blocks_after": s.kv_blocks_total,
                    }
                )
            seen, before = s.swaps_timed, s
            if s.swaps_up >= n or s.swap_failures:
                break
            if time.monotonic() > deadline:
                truncated = True
                break
        engine.abort_all()
        end = engine.stats()
    finally:
        close(engine, device)
        del engine
    base = [st["ms"] for st in steps if st["iteration"] < WARMUP and not st["prefill"]]
    during = [st for st in steps if st["iteration"] >= WARMUP]
    decode_only = [st["ms"] for st in during if not st["prefill"]]
    with_prefill = [st["ms"] for st in during if st["prefill"]]
    baseline = statistics.median(base) if base else None
    worst = max(decode_only, default=None)
    checks = {
        "all_swapped_down": end.swaps_down >= n,
        "all_restored": end.swaps_up >= n,
        "no_swap_failures": end.swap_failures == 0,
        "no_invariant_violations": end.invariant_violations == 0,
        "no_request_errors": not outs.errors(),
        "no_stall": baseline is not None and worst is not None and worst <= 2 * baseline,
    }
    return {
        "layers_swapped": n,
        "batch": B,
        "prompt_tokens": PROMPT,
        "max_tokens": max_tokens,
        "load_s": round(load_s, 2),
        "truncated_by_budget": truncated,
        "requests_added": added[0],
        "kv_blocks": {
            "start": s0.kv_blocks_total,
            "peak": max(st["kv_blocks"] for st in steps),
            "end": end.kv_blocks_total,
        },
        "down": _summary(swaps, "down"),
        "up": _summary(swaps, "up"),
        "swaps": swaps,
        "baseline_decode_step_ms": baseline,
        "steps_during_swaps": len(during),
        "max_decode_step_ms_during_swaps": worst,
        "stall_ms": worst - baseline if worst is not None and baseline is not None else None,
        "max_step_ms_with_prefill": max(with_prefill, default=None),
        "steps_with_prefill": len(with_prefill),
        "step_ms": [round(st["ms"], 3) for st in steps],
        "memory_budget_bytes": end.memory_budget_bytes,
        "checks": checks,
        "ok": all(checks.values()),
    }
