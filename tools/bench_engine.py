"""Engine benchmark: prefill and decode throughput, the engine's overhead over its matmuls, memory, swaps.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=20000 python -m tools.bench_engine [--fragment-dir DIR] [--batches 1 8 16 32] \
        [--weight-dtype float16] [--json FILE]

Prints one table. Beside batch 1 it prints the memory-bandwidth floor (bytes of weights read per token over
the measured read bandwidth); beside every batch the time of the same step's matmuls alone (same shapes, dtype
and kernel as the engine), so the engine's own overhead shows as a ratio, and the same matmuls with
`F.linear` (MKL), so the C++ decode kernel's gain shows too. Numbers are medians of one run on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.build_fragments import default_fragment_dir
from plugins import cpu_kernels, skinny_gemm
from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.sampling import SamplingParams


def median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes/s of a streaming read (sum over a buffer far larger than the caches)."""
    buf = torch.ones(128 << 20)  # 512 MB
    return buf.numel() * 4 / median_time(buf.sum, 5)


def matmuls_alone(engine: LLMEngine, batch: int, dtype: torch.dtype | None = None, linear=skinny_gemm.linear) -> float:
    """The step's matmuls only: every layer's fused qkv, o, gate_up, down, and the LM head, for `batch` rows,
    through `linear` (default: the engine's own dispatch), on the weights as the engine stores them or on
    copies in `dtype`."""
    act = dtype or engine.config.torch_dtype
    ws = []
    for s in engine.model.slots:
        w = s.weights
        ws += [w.qkv.weight, w.o.weight, w.gate_up.weight, w.down.weight]
    ws.append(engine.model.lm_head)
    if dtype is not None:
        ws = [w.to(dtype) for w in ws]
    ws, head = ws[:-1], ws[-1]
    xs = {n: torch.randn(batch, n, dtype=act) for n in {w.shape[1] for w in ws}}

    def run():
        for w in ws:
            linear(xs[w.shape[1]], w)
        linear(xs[head.shape[1]], head)

    with torch.inference_mode():
        return median_time(run, 7)


def decode_step_time(engine: LLMEngine, batch: int, steps: int = 8) -> float:
    for i in range(batch):
        engine.add_request(f"Chapter {i}. It was a bright cold day in April, and the clocks were striking", SamplingParams(max_tokens=steps + 8, ignore_eos=True), lambda o: None)
    engine.step()  # takes the new requests
    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    t = median_time(engine.step, steps, warmup=2)
    engine.abort_all()
    return t


def prefill_rate(engine: LLMEngine, tokens: int = 512) -> float:
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)
    ids = engine.tokenizer.encode(text)[:tokens]
    prompt = engine.tokenizer.decode(ids)

    def once():
        engine.add_request(prompt, SamplingParams(max_tokens=1), lambda o: None)
        engine.run_until_idle()

    return len(engine.tokenizer.encode(prompt)) / median_time(once, 3, warmup=1)


def swap_latencies(frag_dir: str, weight_dtype: str, layers: int = 4) -> list[tuple[float, float]]:
    """(prepare_s, apply_s) of `layers` forced swaps down, then as many restores (after one short request
    moves the engine to iteration 1)."""
    engine = LLMEngine(EngineConfig(fragment_dir=frag_dir, morph_policy="full", weight_dtype=weight_dtype,
                                    force_morph=f"down:{layers}@0,up:{layers}@1"))
    if not engine.settle_morph():
        raise RuntimeError("forced swaps down did not finish")
    if engine.stats().int4_layers == 0:  # no INT4 fragments: nothing to time
        return []
    engine.add_request("The capital of France is", SamplingParams(max_tokens=1), lambda o: None)
    engine.run_until_idle()
    if not engine.settle_morph():
        raise RuntimeError("forced restores did not finish")
    return list(engine.stats().swap_timings)


def peak_rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fragment-dir", default=str(default_fragment_dir()))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--policy", default="full", help="morph policy of the measured engine (full, int4, int4:N)")
    ap.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "float16"],
                    help="storage of the full-precision weights (float16: fp32 compute on 16-bit weights)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(fragment_dir=args.fragment_dir, morph_policy=args.policy, max_batch_size=max(args.batches),
                                    weight_dtype=args.weight_dtype))
    dtype = engine.config.torch_dtype
    print(f"[bench] policy={args.policy} dtype={dtype} weights={engine.config.weight_torch_dtype} threads={torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} "
          f"C++ kernels={'yes' if cpu_kernels.ops() is not None else 'no'}")
    bw = read_bandwidth()
    weight_bytes = engine.model.weights_nbytes
    rows = {"bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "weight_dtype": str(engine.config.weight_torch_dtype),
            "decode": []}
    rows["prefill_tok_s"] = prefill_rate(engine)
    print(f"[bench] read bandwidth {bw / 1e9:.1f} GB/s; weights read per step {weight_bytes / 1e6:.0f} MB; prefill {rows['prefill_tok_s']:.0f} tok/s (512-token prompt)")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>8} {'matmuls ms':>11} {'step/matmuls':>13} {'MKL matmuls ms':>15} {'floor tok/s':>12}")
    for b in args.batches:
        step = decode_step_time(engine, b)
        full = args.policy == "full"
        mm = matmuls_alone(engine, b) if full else float("nan")
        mkl = matmuls_alone(engine, b, dtype, F.linear) if full else float("nan")
        floor = bw / weight_bytes if b == 1 else None
        rows["decode"].append({"batch": b, "step_s": step, "tok_s": b / step, "matmuls_s": mm, "mkl_matmuls_s": mkl,
                               "floor_tok_s": floor})
        fl = f"{floor:12.1f}" if floor else f"{'':>12}"
        print(f"{b:>5} {step * 1e3:8.1f} {b / step:8.1f} {mm * 1e3:11.1f} {step / mm:13.2f} {mkl * 1e3:15.1f} {fl}")
    if args.policy == "full":
        f32, bf16 = matmuls_alone(engine, 1, torch.float32), matmuls_alone(engine, 1, torch.bfloat16)
        f32_16, bf16_16 = matmuls_alone(engine, 16, torch.float32), matmuls_alone(engine, 16, torch.bfloat16)
        # NOTE: fp32 goes through the engine's kernel, bf16 through MKL (the kernel is fp32 only).
        rows["dtype_choice"] = {"fp32_b1": f32, "bf16_b1": bf16, "fp32_b16": f32_16, "bf16_b16": bf16_16}
        print(f"[bench] dtype check, all matmuls of a step: batch 1 fp32 {f32 * 1e3:.1f} ms vs bf16 {bf16 * 1e3:.1f} ms; batch 16 fp32 {f32_16 * 1e3:.1f} vs bf16 {bf16_16 * 1e3:.1f} ms")
    del engine
    swaps = swap_latencies(args.fragment_dir, args.weight_dtype)
    if swaps:
        prep = [p for p, _ in swaps]
        apply = [a for _, a in swaps]
        b1 = rows["decode"][0]["step_s"]
        rows["swap"] = {"prepare_s": prep, "apply_s": apply}
        print(f"[bench] swap per layer: prepare median {statistics.median(prep) * 1e3:.1f} ms (background), apply median "
              f"{statistics.median(apply) * 1e3:.2f} ms / max {max(apply) * 1e3:.2f} ms (engine thread) vs one batch-{args.batches[0]} decode step {b1 * 1e3:.1f} ms")
    rows["peak_rss_bytes"] = peak_rss()
    print(f"[bench] peak RSS {rows['peak_rss_bytes'] / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
