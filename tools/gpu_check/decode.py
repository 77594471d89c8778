"""Decode speed: tok/s of pure decode steps at each batch, every layer full and then every layer INT4, with the
memory-bandwidth floor beside each (bytes a step reads / the measured copy bandwidth).

The steps are timed as tools/bench_engine.py times them (its decode_step_time: short prompts prefilled first, then
the median of several steps); each step ends in sampling, which waits for the device.
"""

from __future__ import annotations

from tools.bench_engine import decode_step_time
from trtllm_backend.manifest import Manifest

from . import device as dev
from .harness import close, make_engine, weights_read_per_step

STEPS = 16
CONTEXT_ROOM = 160  # KV tokens per request: bench_engine's 17-token prompts, the tokens made while the batch prefills


def run(
    fragment_dir,
    device: str,
    threads: int | None,
    batches: list[int],
    bandwidth: float | None,
    policies=("full", "int4"),
) -> dict:
    out = {
        "steps_timed": STEPS,
        "batches": batches,
        "bandwidth_GBps": round(bandwidth / 1e9, 1) if bandwidth else None,
        "floor_means": "bytes read per step (weights as bound, final norm, LM head, cached K/V) / copy bandwidth",
    }
    for policy in policies:
        dev.reset_peak(device)
        engine, load_s = make_engine(
            fragment_dir,
            device,
            threads,
            morph_policy=policy,
            max_batch_size=max(batches),
            max_tokens_in_paged_kv_cache=max(batches) * CONTEXT_ROOM,
            prefill_chunk_tpot_share=0.0,
        )
        try:
            weights = weights_read_per_step(engine)
            rows = []
            for b in batches:
                step_s, kv = decode_step_time(engine, b, steps=STEPS)
                floor_s = (weights + kv) / bandwidth if bandwidth else None
                rows.append(
                    {
                        "batch": b,
                        "step_ms": round(step_s * 1e3, 3),
                        "tok_s": round(b / step_s, 1),
                        "bytes_read_per_step": weights + kv,
                        "floor_step_ms": floor_s * 1e3 if floor_s else None,
                        "floor_tok_s": round(b / floor_s, 1) if floor_s else None,
                        "share_of_floor": floor_s / step_s if floor_s else None,
                    }
                )
                floor = (
                    f", floor {rows[-1]['floor_tok_s']:.1f} tok/s ({rows[-1]['share_of_floor']:.0%} of it)"
                    if floor_s
                    else ""
                )
                print(
                    f"[gpu_check] decode {policy} batch {b}: {rows[-1]['tok_s']:.1f} tok/s, "
                    f"step {rows[-1]['step_ms']:.2f} ms{floor}",
                    flush=True,
                )
            out[policy] = {
                "load_s": round(load_s, 2),
                "int4_layers": engine.stats().int4_layers,
                "weights_read_per_step": weights,
                "rows": rows,
                "invariant_violations": engine.stats().invariant_violations,
                **dev.peak_bytes(device),
            }
        finally:
            close(engine, device)
            del engine
    layers = Manifest(fragment_dir).num_layers
    want = {"full": 0, "int4": layers}
    out["ok"] = all(
        out[p]["invariant_violations"] == 0 and out[p]["int4_layers"] == want.get(p, out[p]["int4_layers"])
        for p in policies
    )  # each policy ran as named, with no broken invariant
    return out
