"""Engine benchmark: prefill and decode throughput, the engine's overhead over its matmuls, memory, swaps.

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=200000 python -m tools.bench_engine [--fragment-dir DIR] [--batches 1 8 16 32] \
        [--weight-dtype float16] [--kv-cache-dtype float16] [--context TOKENS] [--policy full int4] [--threads N] [--json FILE]

Prints one table per policy. Decode steps follow a 17-token prompt, or with --context prompts of that many
tokens. Beside batch 1 it prints the memory-bandwidth floor (bytes of weights and cached K/V read per token over
the read bandwidth) and the share of it reached. The bandwidth is the fastest of several ways of reading a buffer
of the step's size (plugins/read_bandwidth.py: numpy, torch, the C++ streaming read on one and all threads, with
and without prefetch), so no engine should read above 100% of it; the former floor's bandwidth (a torch sum over
512 MB) and the share it gave are kept beside it (`_torch_sum`), as older results used it. Beside every batch the time of the same
step's matmuls alone (the engine's own operators: dense kernel or INT4, and the LM head), so the engine's own
overhead shows as a ratio, and for dense weights the same matmuls with `F.linear` (MKL), so the C++ decode
kernel's gain shows too. `--fused-ab` adds per batch the step with the fused decode call off and on,
alternating in one engine (plugins/decode_layer.py). With several policies (e.g. `--policy full int4`) a
last table gives each one's tok/s per batch over the first's; those run one after the other, so the VM's drift
between them enters the ratio. `--interleave ROUNDS` then loads every policy at once and times their steps
taking turns, which keeps the drift out. Numbers are medians of one run on a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.build_fragments import default_fragment_dir
from plugins import cpu_kernels, skinny_gemm
from plugins import decode_layer as fused_decode
from plugins.int8_linear import head_activations, q8_kernel_supported
from plugins.read_bandwidth import floor_bandwidth
from tools.replay.provenance import code_version, now_utc
from trtllm_backend import huge_pages
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


def floor_read(nbytes: int, rounds: int = 2) -> dict:
    """The floor's read bandwidth at a working set of `nbytes` (a decode step's bytes), on 2 MiB pages as the
    weights are: every method of plugins.read_bandwidth, the fastest wins."""
    return floor_bandwidth(nbytes, alloc=huge_pages.empty, rounds=rounds)


def read_bandwidth(threads: int | None = None) -> float:
    """Bytes/s of a torch sum over 512 MB, on the engine's threads or on `threads`: the former floor's bandwidth
    (kept beside the new one; it under-reads: plugins/read_bandwidth.py)."""
    buf = torch.ones(128 << 20)  # 512 MB
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return buf.numel() * 4 / median_time(buf.sum, 5)
    finally:
        torch.set_num_threads(before)


def _in_features(op) -> int:
    return op.weight.shape[1] if hasattr(op, "weight") else op.in_features


def matmuls_alone(engine: LLMEngine, batch: int, dtype: torch.dtype | None = None, linear=None) -> float:
    """The step's matmuls only: every layer's fused qkv, o, gate_up, down, and the LM head, for `batch` rows.
    `linear` None: each layer's own operator as the engine binds it (dense kernel or INT4); else
    `linear(x, weight)` on the dense weights as stored or on copies in `dtype` (nan if a layer is not dense)."""
    act = dtype or engine.config.torch_dtype
    ops = [op for s in engine.model.slots for op in (s.weights.qkv, s.weights.o, s.weights.gate_up, s.weights.down)]
    head = engine.model.lm_head
    # A tensor at full precision; a table with .linear (the INT8 head unit) when morphed.
    head_call = head.linear if not isinstance(head, torch.Tensor) else (lambda x: skinny_gemm.linear(x, head))
    head_in = head.shape[1]
    if linear is None and dtype is None:
        calls = [(op, _in_features(op)) for op in ops] + [(head_call, head_in)]
    else:
        if not all(hasattr(op, "weight") for op in ops) or not isinstance(head, torch.Tensor):
            return float("nan")
        ws = [op.weight for op in ops] + [head]
        if dtype is not None:
            ws = [w.to(dtype) for w in ws]
        lin = linear or skinny_gemm.linear
        calls = [((lambda x, w=w: lin(x, w)), w.shape[1]) for w in ws]
    xs = {n: torch.randn(batch, n, dtype=act) for n in {k for _, k in calls}}

    def run():
        for fn, k in calls:
            fn(xs[k])

    with torch.inference_mode():
        return median_time(run, 7)


def decode_step_time(engine: LLMEngine, batch: int, steps: int = 8, context: int = 0) -> tuple[float, int]:
    """The median decode step (s) and the cached K/V bytes its first one read."""
    start_decode(engine, batch, max_tokens=steps + 8, context=context)
    kv = kv_bytes_read(engine)
    t = median_time(engine.step, steps, warmup=2)
    engine.abort_all()
    return t, kv


def alternating_ab(engine: LLMEngine, batch: int, use, steps: int = 10, context: int = 0) -> tuple[float, float]:
    """Median decode step (s) under setting A and under B, alternating step by step in one engine so that the
    machine's drift hits both; `use(flag)` switches to A (False) or B (True) and back to the default (None)."""
    start_decode(engine, batch, max_tokens=2 * steps + 8, context=context)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for rep in range(steps + 1):
            for flag in (False, True):
                use(flag)
                t = time.perf_counter()
                engine.step()
                if rep:  # the first pair warms up
                    times[flag].append(time.perf_counter() - t)
    finally:
        use(None)
        engine.abort_all()
    return statistics.median(times[False]), statistics.median(times[True])


def ab_table(
    engine: LLMEngine, batches, use, title: str, a: str, b: str, steps: int = 10, context: int = 0
) -> list[dict]:
    """Per batch, decode steps alternating between setting A and B (alternating_ab), printed and returned."""
    print(f"[bench] {title}, steps alternating: {'batch':>5} {a + ' ms':>16} {b + ' ms':>16} {'A/B':>7}")
    out = []
    for batch in batches:
        ta, tb = alternating_ab(engine, batch, use, steps=steps, context=context)
        out.append({"batch": batch, f"{a}_step_s": ta, f"{b}_step_s": tb})
        print(f"[bench] {'':>{len(title) + 20}} {batch:>5} {ta * 1e3:16.2f} {tb * 1e3:16.2f} {ta / tb:7.3f}")
    return out


def fused_switch():
    """A: the per-op decode, B: the fused decode call (MORPHSERVE_FUSED_DECODE is read per step); None: as before."""
    before = os.environ.get("MORPHSERVE_FUSED_DECODE")

    def use(flag: bool | None) -> None:
        if flag is not None:
            os.environ["MORPHSERVE_FUSED_DECODE"] = "1" if flag else "0"
        elif before is None:
            os.environ.pop("MORPHSERVE_FUSED_DECODE", None)
        else:
            os.environ["MORPHSERVE_FUSED_DECODE"] = before

    return use


def avx512_switch(engine: LLMEngine):
    """A: the kernels without AVX-512 (AVX2 INT4 tiles, the INT8 head on fp32 activations, 2-row dense tiles),
    B: with it (VNNI INT4 tiles, the W8A8 head, 4-row dense tiles). The tile switches are process-wide; the head's
    activations are the engine's numerics."""

    def use(flag: bool | None) -> None:
        on = flag is None or flag
        cpu_kernels.ops().int4_vnni(1 if on else 0)
        cpu_kernels.ops().dense_wide_tile(1 if on else 0)
        engine.set_kernel_numerics(replace(engine.numerics, lm_head_activations="auto" if on else "float32"))

    return use


# The INT4 tiles' software prefetch distance as built (int4_tile.h), read once before any A/B moves it.
DEFAULT_PREFETCH = cpu_kernels.ops().int4_prefetch(-1) if cpu_kernels.ops() is not None else 0


def use_prefetch(flag: bool | None) -> None:
    """A: the INT4 tiles (int8 activations) without software prefetch, B: with the built-in distance."""
    cpu_kernels.ops().int4_prefetch(DEFAULT_PREFETCH if flag is None or flag else 0)


def use_dense_prefetch(flag: bool | None) -> None:
    """A: the dense kernels (full-precision layers, LM head) without software prefetch, B: with it (into L2)."""
    cpu_kernels.ops().dense_prefetch(0 if flag is False else 1)


def use_kv_prefetch(flag: bool | None) -> None:
    """A: the attention passes without software prefetch of the cached K/V rows, B: with it (into L2)."""
    cpu_kernels.ops().kv_prefetch(0 if flag is False else 1)


PREFILL_TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)


def prefill_rate(engine: LLMEngine, tokens: int = 512) -> float:
    ids = engine.tokenizer.encode(PREFILL_TEXT)[:tokens]
    prompt = engine.tokenizer.decode(ids)

    def once():
        engine.add_request(prompt, SamplingParams(max_tokens=1), lambda o: None)
        engine.run_until_idle()

    return len(engine.tokenizer.encode(prompt)) / median_time(once, 3, warmup=1)


def prefill_ab(
    engine: LLMEngine, modes=("bfloat16", "decode"), reps: int = 5, long: int = 512, streams: int = 16, short: int = 128
) -> list[dict]:
    """Prefill tok/s of the INT4 layers' prefill paths (EngineConfig.int4_prefill), alternating pass by pass in
    one engine: a `long`-token prompt, and `streams` prompts of `short` tokens arriving together (bench_peers'
    shape at 16 streams)."""
    ids = engine.tokenizer.encode(PREFILL_TEXT)
    shapes = {
        f"1 x {long}": [engine.tokenizer.decode(ids[:long])],
        f"{streams} x {short}": [engine.tokenizer.decode(ids[i : i + short]) for i in range(streams)],
    }
    previous = engine.set_kernel_numerics(replace(engine.numerics, int4_prefill=modes[0]))
    out = []
    try:
        for name, prompts in shapes.items():
            tokens = sum(len(engine.tokenizer.encode(p)) for p in prompts)
            times: dict[str, list[float]] = {m: [] for m in modes}
            for rep in range(reps + 1):
                for m in modes:
                    engine.set_kernel_numerics(replace(engine.numerics, int4_prefill=m))
                    t = time.perf_counter()
                    for p in prompts:
                        engine.add_request(p, SamplingParams(max_tokens=1), lambda o: None)
                    engine.run_until_idle()
                    if rep:  # the first pass of each warms up
                        times[m].append(time.perf_counter() - t)
            out.append(
                {
                    "prompts": name,
                    "tokens": tokens,
                    **{f"{m}_tok_s": tokens / statistics.median(ts) for m, ts in times.items()},
                }
            )
    finally:
        engine.set_kernel_numerics(previous)
    return out


def swap_latencies(
    frag_dir: str, weight_dtype: str, layers: int = 4, threads: int | None = None
) -> list[tuple[float, float]]:
    """(prepare_s, apply_s) of `layers` forced swaps down, then as many restores (after one short request
    moves the engine to iteration 1)."""
    engine = LLMEngine(
        EngineConfig(
            fragment_dir=frag_dir,
            morph_policy="full",
            weight_dtype=weight_dtype,
            num_threads=threads,
            force_morph=f"down:{layers}@0,up:{layers}@1",
        )
    )
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


def make_engine(args, policy: str, huge_pages: bool = True) -> LLMEngine:
    """An engine for `policy` (a morph policy with an optional @ suffix, see --policy), its kernel settings
    applied (@avx2's tile switches process-wide); `huge_pages`: EngineConfig.huge_pages."""
    morph_policy, _, suffix = policy.partition("@")
    options = [o for o in suffix.split(",") if o]
    unknown = set(options) - {"int8", "float32", "avx2", "bf16"}
    if unknown:
        raise SystemExit(f"--policy {policy}: unknown option(s) {sorted(unknown)} after @ (int8, float32, avx2, bf16)")
    avx2 = "avx2" in options
    activations = next((o for o in options if o not in ("avx2", "bf16")), "int8")
    engine = LLMEngine(
        EngineConfig(
            fragment_dir=args.fragment_dir,
            morph_policy=morph_policy,
            max_batch_size=max(args.batches),
            weight_dtype="bfloat16" if "bf16" in options else args.weight_dtype,
            num_threads=args.threads,
            kv_cache_dtype=args.kv_cache_dtype,
            int4_activations=activations,
            int4_prefill=args.int4_prefill,
            lm_head_activations="float32" if avx2 else "auto",
            huge_pages=huge_pages,
        )
    )
    if cpu_kernels.ops() is not None:
        avx512_switch(engine)(not avx2)
    return engine


def context_prompt(engine: LLMEngine, i: int, context: int) -> str:
    """Request i's prompt: a short sentence, or with `context` > 0 one of about that many tokens."""
    prompt = f"Chapter {i}. It was a bright cold day in April, and the clocks were striking"
    if context <= 0:
        return prompt
    ids = engine.tokenizer.encode(prompt + " " + PREFILL_TEXT * (1 + context // 600))[:context]
    return engine.tokenizer.decode(ids)


def kv_bytes_read(engine: LLMEngine) -> int:
    """Bytes of cached K/V the next decode step's attention reads: every running request's tokens, all layers."""
    pool = engine.pool
    return sum(r.num_tokens for r in engine.scheduler.running) * pool.bytes_per_block // pool.block_size


def start_decode(engine: LLMEngine, batch: int, max_tokens: int, context: int = 0) -> None:
    """`batch` requests admitted and prefilled (prompts of about `context` tokens, or short), so the engine's next
    steps are pure decode steps."""
    # NOTE: the first prompts decode while the later ones are prefilled in chunks: room for those tokens too,
    # then each is left `max_tokens` from where it is, so that none finishes before the timed steps.
    longest = max(len(engine.tokenizer.encode(context_prompt(engine, i, context))) for i in range(batch))
    room = min(engine.max_model_len, engine.config.base_kv_blocks * engine.config.block_size) - longest
    during_prefill = min(room, max_tokens + batch * longest // 16 + 16)
    for i in range(batch):
        engine.add_request(
            context_prompt(engine, i, context),
            SamplingParams(max_tokens=during_prefill, ignore_eos=True),
            lambda o: None,
        )
    engine.step()  # takes the new requests
    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    for r in engine.scheduler.running:
        r.params.max_tokens = min(r.params.max_tokens, r.num_output + max_tokens)
    decoding = len(engine.scheduler.running)
    if decoding != batch:  # the pool holds fewer such prompts: the steps would not be batch-`batch` decode steps
        engine.abort_all()
        raise SystemExit(
            f"[bench] batch {batch} at a context of {context or 'a short prompt'}: {decoding} of {batch} "
            f"requests decode together in the KV pool ({engine.pool.num_blocks} blocks of "
            f"{engine.pool.block_size} tokens); give smaller --batches or --context"
        )


def steps_taking_turns(engines: dict[str, LLMEngine], steps: int) -> dict[str, float]:
    """Each engine's median decode step (s), the engines stepping in turn `steps` times (after one warm-up turn)."""
    times: dict[str, list[float]] = {p: [] for p in engines}
    for s in range(steps + 1):
        for p, e in engines.items():
            t = time.perf_counter()
            e.step()
            if s:  # the first turn warms up
                times[p].append(time.perf_counter() - t)
    return {p: statistics.median(ts) for p, ts in times.items()}


def round_ratios(per_round: list[dict[str, float]], a: str, b: str) -> dict:
    """Per round a's step over b's: the median round with the lowest and highest."""
    ratios = sorted(r[a] / r[b] for r in per_round)
    return {"median": statistics.median(ratios), "low": ratios[0], "high": ratios[-1]}


def huge_pages_ab(args, policy: str, engine: LLMEngine, rounds: int = 5, steps: int = 8) -> list[dict]:
    """Per batch, `engine` (weights and KV on 2 MiB pages) and a twin on 4 KiB pages (EngineConfig.huge_pages
    off) taking turns step by step, `rounds` rounds: what the pages alone give, the drift hitting both."""
    small = make_engine(args, policy, huge_pages=False)
    engines = {"4KiB": small, "2MiB": engine}
    print(
        f"[bench] huge pages A/B, engines taking turns, {rounds} rounds of {steps} steps: "
        f"{'batch':>5} {'4 KiB pages ms':>15} {'2 MiB pages ms':>15} {'4 KiB/2 MiB':>22}"
    )
    out = []
    with torch.inference_mode():
        for b in args.batches:
            for e in engines.values():
                start_decode(e, b, max_tokens=rounds * (steps + 1) + 8, context=args.context)
            try:
                per_round = [steps_taking_turns(engines, steps) for _ in range(rounds)]
            finally:
                for e in engines.values():
                    e.abort_all()
            row = {
                "batch": b,
                **{f"{p}_step_s": statistics.median(r[p] for r in per_round) for p in engines},
                "ratio": round_ratios(per_round, "4KiB", "2MiB"),
            }
            out.append(row)
            r = row["ratio"]
            print(
                f"[bench] {'':>62} {b:>5} {row['4KiB_step_s'] * 1e3:15.2f} {row['2MiB_step_s'] * 1e3:15.2f} "
                f"{r['median']:10.3f} [{r['low']:.3f}, {r['high']:.3f}]"
            )
    del small
    gc.collect()
    return out


def interleaved_policies(args, rounds: int, steps: int = 8) -> dict:
    """Every policy's decode step per batch with all the engines loaded at once, taking turns step by step, and
    the read bandwidth measured before each round: the VM's drift, which made sequential runs read 1.56x and
    1.98x for the same batch-1 ratio, hits every policy alike. Per round the ratio of medians to the first
    policy; reported as the median round with the lowest and highest."""
    if any("avx2" in p.partition("@")[2].split(",") for p in args.policy):
        raise SystemExit(
            "--interleave: @avx2 sets process-wide kernel settings (the tiles), which engines taking "
            "turns would share; the activations (@int8, @float32) are each engine's own"
        )
    engines = {p: make_engine(args, p) for p in args.policy}
    first = args.policy[0]
    out = {"rounds": rounds, "steps_per_round": steps, "batches": []}
    print(
        f"[bench] interleaved: {', '.join(args.policy)} loaded at once, taking turns step by step; "
        f"{rounds} rounds of {steps} steps each per batch; ratios: median round [lowest, highest]"
    )
    print(
        f"{'batch':>5} {'GB/s':>5} "
        + " ".join(f"{p + ' ms':>12}" for p in args.policy)
        + " "
        + " ".join(f"{p + '/' + first + ' tok/s':>26}" for p in args.policy[1:])
        + "  of floor (batch 1)"
    )
    with torch.inference_mode():
        for b in args.batches:
            for e in engines.values():
                start_decode(e, b, max_tokens=rounds * (steps + 1) + 8, context=args.context)
            kv = {p: kv_bytes_read(e) for p, e in engines.items()}
            step_bytes = {p: engines[p].model.weights_nbytes + kv[p] for p in engines}
            per_round, bws, floors = [], [], {p: [] for p in engines}
            try:
                for _ in range(rounds):
                    bws.append(read_bandwidth())
                    if b == 1:  # each policy's floor bandwidth at its own step's bytes, once a round
                        for p in engines:
                            floors[p].append(floor_read(step_bytes[p], rounds=1))
                    per_round.append(steps_taking_turns(engines, steps))
            finally:
                for e in engines.values():
                    e.abort_all()
            bw = statistics.median(bws)
            row = {
                "batch": b,
                "bandwidth_GBps": [x / 1e9 for x in bws],
                "step_s": {p: statistics.median(r[p] for r in per_round) for p in engines},
                "tok_s_over_first": {},
            }
            for p in args.policy[1:]:
                row["tok_s_over_first"][p] = round_ratios(per_round, first, p)
            if b == 1:
                # the floor's bandwidth: the best any method read over the rounds, at the policy's own step bytes
                row["step_bytes"] = step_bytes
                row["floor_read"] = {p: max(f, key=lambda r: r["floor_GBps"]) for p, f in floors.items()}
                row["floor_GBps"] = {p: r["floor_GBps"] for p, r in row["floor_read"].items()}
                row["share_of_floor"] = {
                    p: step_bytes[p] / (row["floor_GBps"][p] * 1e9) / row["step_s"][p] for p in engines
                }
                row["share_of_floor_torch_sum"] = {p: step_bytes[p] / bw / row["step_s"][p] for p in engines}
            out["batches"].append(row)
            ratio_txt = " ".join(
                f"{r['median']:12.2f} [{r['low']:.2f}, {r['high']:.2f}]".rjust(26)
                for r in row["tok_s_over_first"].values()
            )
            floor_txt = (
                (
                    "  "
                    + ", ".join(
                        f"{p} {v:.0%} (floor {row['floor_GBps'][p]:.1f} GB/s {row['floor_read'][p]['floor_method']}, "
                        f"torch-sum floor {row['share_of_floor_torch_sum'][p]:.0%})"
                        for p, v in row["share_of_floor"].items()
                    )
                )
                if b == 1
                else ""
            )
            print(
                f"{b:>5} {bw / 1e9:5.1f} "
                + " ".join(f"{row['step_s'][p] * 1e3:12.2f}" for p in args.policy)
                + " "
                + ratio_txt
                + floor_txt
            )
    return out


def bench_policy(args, policy: str) -> dict:
    """One engine with `policy`: prefill, then per batch the decode step, its matmuls alone and the floor."""
    # e.g. int4@float32: the INT4 kernel's activations; int4@avx2: the kernels without AVX-512 (INT4 tiles on
    # AVX2, the INT8 head with fp32 activations, 2-row dense tiles), to measure what AVX-512 gives in the same run
    morph_policy, _, suffix = policy.partition("@")
    avx2 = "avx2" in suffix.split(",")
    engine = make_engine(args, policy)
    vnni = (
        cpu_kernels.ops() is not None and bool(cpu_kernels.ops().int4_vnni(-1)) and q8_kernel_supported()
    )  # the CPU has it
    dtype = engine.config.torch_dtype
    print(
        f"[bench] policy={policy} int4 activations={engine.numerics.int4_activations} int4 prefill={engine.numerics.int4_prefill} "
        f"AVX-512 VNNI tiles={'yes' if vnni else 'no'} lm_head activations={head_activations()} "
        f"dtype={dtype} weights={engine.config.weight_torch_dtype} kv={engine.pool.dtype} threads={torch.get_num_threads()} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} "
        f"C++ kernels={'yes' if cpu_kernels.ops() is not None else 'no'} "
        f"fused decode layer={'yes' if cpu_kernels.ops() is not None and fused_decode.enabled() else 'no'}"
    )
    bw = read_bandwidth()
    # NOTE: one core's streaming rate beside the floor's: where it is near the whole machine's, a kernel that
    # stays under it on one core is bound by its own work per byte, not by the memory the floor assumes.
    bw1 = read_bandwidth(threads=1)
    weight_bytes = engine.model.weights_nbytes
    huge = huge_pages.anon_huge_bytes()
    print(
        f"[bench] 2 MiB pages: EngineConfig.huge_pages={engine.config.huge_pages}, the kernel's THP setting "
        f"'{huge_pages.thp_mode()}'; {huge / 1e6:.0f} MB of the process on huge pages beside {weight_bytes / 1e6:.0f} MB "
        f"of weights"
    )
    rows = {
        "huge_pages": engine.config.huge_pages,
        "thp_mode": huge_pages.thp_mode(),
        "anon_huge_bytes": huge,
        "policy": policy,
        "bandwidth_GBps": bw / 1e9,
        "bandwidth_1thread_GBps": bw1 / 1e9,
        "weight_bytes": weight_bytes,
        "weight_dtype": str(engine.config.weight_torch_dtype),
        "threads": torch.get_num_threads(),
        "decode": [],
    }
    rows["prefill_tok_s"] = prefill_rate(engine)
    print(
        f"[bench] read bandwidth {bw / 1e9:.1f} GB/s (one thread {bw1 / 1e9:.1f}); weights read per step {weight_bytes / 1e6:.0f} MB; prefill {rows['prefill_tok_s']:.0f} tok/s (512-token prompt)"
    )
    rows["context"] = args.context
    print(
        f"{'batch':>5} {'step ms':>8} {'tok/s':>8} {'matmuls ms':>11} {'step/matmuls':>13} {'MKL matmuls ms':>15} {'floor tok/s':>12} {'of floor':>9}"
    )
    for b in args.batches:
        step, kv = decode_step_time(engine, b, context=args.context)
        mm = matmuls_alone(engine, b)
        mkl = matmuls_alone(engine, b, dtype, F.linear)
        # NOTE: the floor reads the cached K/V too: at a long context they weigh like a share of the weights.
        floor = None
        if b == 1:
            read = floor_read(weight_bytes + kv)
            rows["floor_read"] = read
            floor = read["floor_GBps"] * 1e9 / (weight_bytes + kv)
            print(
                f"[bench] batch 1 at {kv // (engine.pool.bytes_per_block // engine.pool.block_size)} cached tokens: "
                f"{kv / 1e6:.1f} MB of K/V per step beside the weights in its floor; floor bandwidth "
                f"{read['floor_GBps']:.1f} GB/s ({read['floor_method']}; "
                + ", ".join(f"{k} {v:.1f}" for k, v in read["GBps"].items())
                + ")"
            )
        rows["decode"].append(
            {
                "batch": b,
                "step_s": step,
                "tok_s": b / step,
                "matmuls_s": mm,
                "mkl_matmuls_s": mkl,
                "kv_bytes": kv,
                "floor_tok_s": floor,
                "share_of_floor": (b / step) / floor if floor else None,
                "share_of_floor_torch_sum": (b / step) * (weight_bytes + kv) / bw if floor else None,
            }
        )
        fl = f"{floor:12.1f} {b / step / floor:9.0%}" if floor else f"{'':>12} {'':>9}"
        print(f"{b:>5} {step * 1e3:8.1f} {b / step:8.1f} {mm * 1e3:11.1f} {step / mm:13.2f} {mkl * 1e3:15.1f} {fl}")
    if args.fused_ab:
        rows["fused_ab"] = ab_table(
            engine, args.batches, fused_switch(), "fused decode A/B", "per_op", "fused", context=args.context
        )
    if args.avx512_ab and not avx2 and vnni:
        rows["avx512_ab"] = ab_table(
            engine, args.batches, avx512_switch(engine), "AVX-512 A/B", "avx2", "avx512", steps=20, context=args.context
        )
    if args.prefetch_ab and morph_policy != "full" and cpu_kernels.ops() is not None:
        rows["prefetch_ab"] = ab_table(
            engine,
            args.batches,
            use_prefetch,
            "INT4 prefetch A/B",
            "no_prefetch",
            f"prefetch_{DEFAULT_PREFETCH}",
            steps=20,
            context=args.context,
        )
    if args.prefetch_ab and morph_policy != "int4" and cpu_kernels.ops() is not None:
        rows["dense_prefetch_ab"] = ab_table(
            engine,
            args.batches,
            use_dense_prefetch,
            "dense prefetch A/B",
            "no_prefetch",
            "prefetch_l2",
            steps=20,
            context=args.context,
        )
    if args.prefetch_ab and cpu_kernels.ops() is not None:
        rows["kv_prefetch_ab"] = ab_table(
            engine,
            args.batches,
            use_kv_prefetch,
            "K/V prefetch A/B",
            "no_prefetch",
            "prefetch_l2",
            steps=20,
            context=args.context,
        )
    if args.huge_pages_ab:
        rows["huge_pages_ab"] = huge_pages_ab(args, policy, engine)
    if args.prefill_ab and morph_policy != "full":
        rows["prefill_ab"] = prefill_ab(engine)
        for r in rows["prefill_ab"]:
            print(
                f"[bench] INT4 prefill A/B, passes alternating: {r['prompts']} tokens: bfloat16 (dequantize + MKL) "
                f"{r['bfloat16_tok_s']:.0f} tok/s, decode tiles {r['decode_tok_s']:.0f} tok/s "
                f"({r['decode_tok_s'] / r['bfloat16_tok_s']:.2f}x)"
            )
    if morph_policy == "full":
        f32, bf16 = (
            matmuls_alone(engine, 1, torch.float32, skinny_gemm.linear),
            matmuls_alone(engine, 1, torch.bfloat16, F.linear),
        )
        f32_16, bf16_16 = (
            matmuls_alone(engine, 16, torch.float32, skinny_gemm.linear),
            matmuls_alone(engine, 16, torch.bfloat16, F.linear),
        )
        # NOTE: fp32 goes through the engine's kernel, bf16 through MKL (the kernel is fp32 only).
        rows["dtype_choice"] = {"fp32_b1": f32, "bf16_b1": bf16, "fp32_b16": f32_16, "bf16_b16": bf16_16}
        print(
            f"[bench] dtype check, all matmuls of a step: batch 1 fp32 {f32 * 1e3:.1f} ms vs bf16 {bf16 * 1e3:.1f} ms; batch 16 fp32 {f32_16 * 1e3:.1f} vs bf16 {bf16_16 * 1e3:.1f} ms"
        )
    return rows


def compare(results: list[dict]) -> dict:
    """Each policy's decode tok/s per batch over the first policy's (e.g. all-INT4 over full)."""
    base = results[0]
    out = {}
    print(f"[bench] decode tok/s per batch, each policy over {base['policy']} (same run, same weight dtype)")
    print(
        f"{'batch':>5} "
        + " ".join(f"{r['policy'] + ' tok/s':>14}" for r in results)
        + " "
        + " ".join(f"{r['policy'] + '/' + base['policy']:>14}" for r in results[1:])
    )
    for i, row in enumerate(base["decode"]):
        tok = [r["decode"][i]["tok_s"] for r in results]
        out[row["batch"]] = {r["policy"]: t / tok[0] for r, t in zip(results[1:], tok[1:])}
        print(
            f"{row['batch']:>5} "
            + " ".join(f"{t:14.1f}" for t in tok)
            + " "
            + " ".join(f"{t / tok[0]:14.2f}" for t in tok[1:])
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fragment-dir", default=str(default_fragment_dir()))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument(
        "--policy",
        nargs="+",
        default=["full"],
        help="morph policies measured in turn (full, int4, int4:N; a suffix @float32 or @int8 sets the INT4 "
        "kernel's activations, default int8; @avx2 (or @int8,avx2) runs the kernels without AVX-512 "
        "(VNNI INT4 tiles, W8A8 head, 4-row dense tiles); @bf16 stores the full-precision weights in bf16 "
        "(weight_dtype=bfloat16); ratios to the first are printed",
    )
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    ap.add_argument(
        "--int4-prefill",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="prefill matmuls of INT4 layers (EngineConfig.int4_prefill)",
    )
    ap.add_argument(
        "--fused-ab",
        action="store_true",
        help="also time decode steps with the fused decode call off and on, alternating step by step",
    )
    ap.add_argument(
        "--avx512-ab",
        "--vnni-ab",
        dest="avx512_ab",
        action="store_true",
        help="also time decode steps without and with the AVX-512 kernels (VNNI INT4 tiles, W8A8 head, "
        "4-row dense tiles), alternating step by step (where the CPU has AVX-512 VNNI)",
    )
    ap.add_argument(
        "--prefetch-ab",
        action="store_true",
        help="also time decode steps with the software prefetch off and on, alternating step by step: "
        "the INT4 tiles' for policies with INT4 layers, the dense kernels' for policies with "
        "full-precision layers, the attention's cached K/V rows for all (see --context)",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=0,
        metavar="TOKENS",
        help="decode with prompts of about TOKENS tokens (default: a 17-token sentence); the batch-1 "
        "floor counts the K/V bytes a step reads beside the weights",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "float16"],
        help="storage of the KV pool (auto: the engine's default, fp32; the served default is float16)",
    )
    ap.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="storage of the full-precision weights (float16: fp32 compute on 16-bit weights; bfloat16: matmuls on "
        "bf16 inputs with fp32 sums)",
    )
    ap.add_argument(
        "--huge-pages-ab",
        action="store_true",
        help="also time decode steps of the engine beside a twin with EngineConfig.huge_pages off (weights "
        "and KV on 4 KiB pages), the two taking turns step by step, 5 rounds per batch",
    )
    ap.add_argument(
        "--prefill-ab",
        action="store_true",
        help="for policies with INT4 layers: also time prefill with int4_prefill bfloat16 and decode, "
        "alternating pass by pass (a 512-token prompt; 16 prompts of 128 tokens)",
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="with several policies: also load all of them at once and time their decode steps taking "
        "turns, ROUNDS rounds per batch (ratios with their range; the batch-1 share of the floor)",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    # What a committed result must say: the command, the code and the machine's load when it ran.
    run = {
        "command": "python -m tools.bench_engine " + " ".join(sys.argv[1:] if argv is None else argv),
        **code_version(),
        "run_utc": now_utc(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }
    results = []
    for policy in args.policy:
        results.append(bench_policy(args, policy))
        gc.collect()  # the engine and its weights go before the next one loads
    rows = dict(results[0])  # the first policy's figures stay at the top level (deploy/sizing.py reads them)
    if len(results) > 1:
        rows["by_policy"] = results
        rows["tok_s_over_first"] = compare(results)
    if args.interleave and len(results) > 1:
        gc.collect()
        rows["interleaved"] = interleaved_policies(args, args.interleave)
    swaps = swap_latencies(args.fragment_dir, args.weight_dtype, threads=args.threads)
    if swaps:
        prep = [p for p, _ in swaps]
        apply = [a for _, a in swaps]
        b1 = rows["decode"][0]["step_s"]
        rows["swap"] = {"prepare_s": prep, "apply_s": apply}
        print(
            f"[bench] swap per layer: prepare median {statistics.median(prep) * 1e3:.1f} ms (background), apply median "
            f"{statistics.median(apply) * 1e3:.2f} ms / max {max(apply) * 1e3:.2f} ms (engine thread) vs one batch-{args.batches[0]} decode step {b1 * 1e3:.1f} ms"
        )
    rows["peak_rss_bytes"] = peak_rss()
    print(f"[bench] peak RSS {rows['peak_rss_bytes'] / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({**run, **rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
