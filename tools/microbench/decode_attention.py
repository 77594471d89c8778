"""Decode attention alone (`morphserve::paged_decode_attention`, one row, SmolLM2's 9 query heads over 3 KV heads
of 64), for one build of the C++ kernels: what a change to plugins/csrc/paged_attention_core.h did.

    python -m tools.microbench.decode_attention [--lib build/kernels/morphserve_kernels.so] [--dump FILE]

- from memory: the 30 layers' cached K/V at 512 and 2048 positions (fp32 and fp16 pools), one layer after
  another, on 1 and 2 threads, the pool on 4 KiB pages and on 2 MiB pages (trtllm_backend.huge_pages, as the
  engine holds it), the two alternating twice: microseconds per layer and GB/s of K/V read, the better pass;
- in cache: one layer at 256 and 1024 positions (fp32 K/V: 384 KB, in L2, and 1.5 MB) on one thread, called over and over:
  nanoseconds per (position, KV head) beyond a one-position call;
- `--dump FILE`: the outputs of 40 cases (1-9 query heads per KV head, head_dim 6-136, fp32 and fp16 pools, 1-513
  positions, 1 and 2 threads) saved as safetensors, to compare two builds bit for bit (`--compare A B`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

KVH, GROUP, D, LAYERS = 3, 3, 64, 30


def _ops(lib: str | None):
    if lib:  # before the first ops(): this process runs that build
        os.environ["MORPHSERVE_KERNELS_LIBRARY"] = lib
    from plugins import cpu_kernels

    ns = cpu_kernels.ops()
    if ns is None:
        raise SystemExit("[attention] the C++ kernels do not load (see the warning above)")
    return ns


def _median_s(fn, reps: int, inner: int = 1) -> float:
    """Median seconds of one fn() call over `reps` timings of `inner` calls each (bench_engine.median_time)."""
    from tools.bench_engine import median_time

    return median_time(lambda: [fn() for _ in range(inner)], reps, warmup=3) / inner


def from_memory(ns) -> None:
    from trtllm_backend import huge_pages

    print(
        f"[attention] from memory: {LAYERS} layers' K/V, one row, {KVH * GROUP} query heads over {KVH} KV heads of {D}"
    )
    for dtype in (torch.float32, torch.float16):
        for n in (512, 2048):
            small = torch.randn(LAYERS, 2, n + 16, KVH, D).to(dtype)
            pools = {"4 KiB": [small], "2 MiB": [huge_pages.empty_tensor(small.shape, dtype).copy_(small)]}
            seg_of, slot_of = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
            q, lens = torch.randn(1, KVH * GROUP, D), torch.tensor([n])
            read = LAYERS * n * KVH * D * 2 * small.element_size()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                best = {pages: float("inf") for pages in pools}
                for _ in range(2):
                    for pages, kv in pools.items():
                        best[pages] = min(
                            best[pages],
                            _median_s(
                                lambda: [
                                    ns.paged_decode_attention(q, kv, seg_of, slot_of, lens, layer, D**-0.5)
                                    for layer in range(LAYERS)
                                ],
                                15,
                            ),
                        )
                print(
                    f"[attention] {str(dtype):>13} {n:5} positions, {threads} thread(s): "
                    + ", ".join(
                        f"{pages} pages {t * 1e6 / LAYERS:6.1f} us a layer {read / t / 1e9:5.1f} GB/s"
                        for pages, t in best.items()
                    ),
                    flush=True,
                )


def in_cache(ns) -> None:
    torch.set_num_threads(1)
    per_call = {}
    for n in (1, 256, 1024):
        kv = [torch.randn(1, 2, n + 16, KVH, D)]
        seg_of, slot_of = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None]
        q, lens = torch.randn(1, KVH * GROUP, D), torch.tensor([n])
        per_call[n] = _median_s(lambda: ns.paged_decode_attention(q, kv, seg_of, slot_of, lens, 0, D**-0.5), 9, 200)
    for n in (256, 1024):
        ns_task = (per_call[n] - per_call[1]) / (n * KVH) * 1e9
        print(
            f"[attention] in cache, one thread, fp32, {n} positions ({n * KVH * D * 8 // 1024} KB): {ns_task:.1f} ns "
            f"per (position, KV head) beyond a one-position call ({per_call[1] * 1e6:.1f} us)"
        )


def dump(ns, path: str) -> None:
    out = {}
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float16):
        for kvh, group, d in [
            (3, 3, 64),
            (2, 3, 136),
            (1, 1, 64),
            (2, 2, 64),
            (1, 4, 64),
            (1, 5, 64),
            (1, 6, 72),
            (1, 9, 64),
            (1, 8, 64),
            (2, 2, 6),
        ]:
            slots, lens = 600, [1, 2, 3, 5, 9, 37, 513]
            kv = [torch.randn(2, 2, slots, kvh, d, generator=g).to(dtype) for _ in range(2)]
            B, H, L = len(lens), kvh * group, max(lens)
            seg_of, slot_of = torch.randint(0, 2, (B, L), generator=g), torch.randint(0, slots, (B, L), generator=g)
            q = torch.randn(B, H, d, generator=g)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out[f"{dtype} kvh={kvh} group={group} d={d} threads={threads}"] = ns.paged_decode_attention(
                    q, kv, seg_of, slot_of, torch.tensor(lens), 1, d**-0.5
                )
    save_file({k: v.contiguous() for k, v in out.items()}, path)
    print(f"[attention] {len(out)} cases' outputs in {path}")


def compare(a: str, b: str) -> int:
    x, y = load_file(a), load_file(b)
    differ = [k for k in x if not torch.equal(x[k], y[k])]
    print(f"[attention] {len(x)} cases, {len(differ)} differ" + (f": {differ}" if differ else " (bitwise equal)"))
    return 1 if differ or x.keys() != y.keys() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="a built morphserve_kernels.so (default: build/kernels/)")
    ap.add_argument("--dump", metavar="FILE", help="only save the 40 cases' outputs here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="only compare two --dump files bit for bit")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    ns = _ops(args.lib)
    if args.dump:
        dump(ns, args.dump)
        return 0
    from_memory(ns)
    in_cache(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
