"""Closed-loop engine throughput with bf16-stored weights, the bf16 dispatch of prefill chunks alternating round
by round in one engine: "torch" (torch's bf16 linear above skinny_gemm.MAX_ROWS rows, the dispatch before
commit 'bf16 prefill chunks on the kernel') against "kernel" (the C++ AVX512_BF16 kernel at every size). The
shape of tools.bench_peers: S streams, each sending 64-token prompts one after another with 32 forced output
tokens, on one thread, no server.

    OMP_WAIT_POLICY=PASSIVE taskset -c 1 python -m tools.microbench.bf16_dispatch_ab --streams 4 8 16 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import time

import torch

import plugins.skinny_gemm as skinny_gemm
from engines.build_fragments import default_fragment_dir
from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.sampling import SamplingParams

KERNEL = skinny_gemm.linear


def torch_above_max_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.shape[0] > skinny_gemm.MAX_ROWS:
        return torch.nn.functional.linear(x.to(torch.bfloat16), w).to(torch.float32)
    return KERNEL(x, w)


def closed_loop_tok_s(engine: LLMEngine, streams: int, per_stream: int, rng: random.Random) -> float:
    left = collections.Counter({s: per_stream for s in range(streams)})

    def send(s: int) -> None:
        ids = [rng.randrange(1000, 20000) for _ in range(64)]
        params = SamplingParams(max_tokens=32, min_tokens=32, ignore_eos=True)
        engine.add_request(engine.tokenizer.decode(ids), params, lambda out: done(s, out))

    def done(s: int, out) -> None:
        if out.finished:
            left[s] -= 1
            if left[s] > 0:
                send(s)

    for s in range(streams):
        send(s)
    t0 = time.perf_counter()
    while sum(left.values()) > 0:
        engine.step()
    return streams * per_stream * 32 / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-stream", type=int, default=4, help="requests each stream sends per round")
    args = ap.parse_args(argv)
    engine = LLMEngine(
        EngineConfig(
            fragment_dir=default_fragment_dir(),
            morph_policy="full",
            weight_dtype="bfloat16",
            num_threads=1,
            max_batch_size=max(args.streams),
        )
    )
    if not skinny_gemm.bf16_kernel_available():
        print("[bf16 ab] no AVX512_BF16 kernel here: both dispatches are torch's")
        return 1
    print(f"[bf16 ab] 1-min load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    rng = random.Random(0)
    for streams in args.streams:
        closed_loop_tok_s(engine, streams, 1, rng)  # warm
        tok_s: dict[str, list[float]] = {"torch": [], "kernel": []}
        for r in range(args.rounds):
            order = (("torch", torch_above_max_rows), ("kernel", KERNEL))
            for name, fn in order if r % 2 == 0 else order[::-1]:
                skinny_gemm.linear = fn
                tok_s[name].append(closed_loop_tok_s(engine, streams, args.per_stream, rng))
        skinny_gemm.linear = KERNEL
        ratios = [k / t for k, t in zip(tok_s["kernel"], tok_s["torch"])]
        print(
            f"[bf16 ab] {streams:2d} streams: torch {statistics.median(tok_s['torch']):.1f} tok/s, kernel "
            f"{statistics.median(tok_s['kernel']):.1f} tok/s, kernel/torch median {statistics.median(ratios):.2f} "
            f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
