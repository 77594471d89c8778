"""The machine's read bandwidth, measured several ways; the floor's denominator is the fastest of them.

A decode step reads every weight once, so "bytes read per step / read bandwidth" is the least time a step can take,
but only if the bandwidth is the best any reader gets. The floor used to come from one `torch.sum` over 512 MB on
the engine's threads; the kernels read faster than that (a committed bench had full precision at 119% of its
floor). Here every method streams the same buffer, each timed as the median of `reps` passes after a warm-up pass:

- `numpy_sum`: numpy's float32 sum (one thread).
- `torch_sum`: torch's sum on all of torch's threads (the former floor's method).
- `stream_1t`, `stream_all`: the C++ streaming read (csrc/read_stream.cpp: loads and integer adds, nothing else)
  on one thread and on all; `_prefetch`: with a software prefetch PREFETCH_BYTES ahead, as the INT4 tiles ask;
  in 64-byte loads where the CPU has AVX-512.

The floor is the maximum. The buffer's size matters: a working set that fits the last-level cache (this VM reports
480 MB of L3) is read faster than one that does not, so the engine bench measures at the bytes its step reads
(the weights and the cached K/V), read again and again as decode steps do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from . import cpu_kernels

PREFETCH_BYTES = 4096  # as plugins/csrc/int4_tile.h's default for the INT4 tiles
METHODS = ("numpy_sum", "torch_sum", "stream_1t", "stream_all", "stream_1t_prefetch", "stream_all_prefetch")


def _buffer(nbytes: int, alloc: Callable[[int], torch.Tensor] | None) -> torch.Tensor:
    nbytes = max(4096, nbytes // 4096 * 4096)
    buf = alloc(nbytes) if alloc else torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)  # touch every page before any timing
    return buf


def _readers(buf: torch.Tensor, threads: int) -> dict[str, Callable[[], object]]:
    f32 = buf.view(torch.float32)
    arr = f32.numpy()
    out: dict[str, Callable[[], object]] = {"numpy_sum": lambda: np.add.reduce(arr), "torch_sum": f32.sum}
    ops = cpu_kernels.ops()
    if ops is not None and hasattr(ops, "read_stream"):
        for name, t, ahead in (
            ("stream_1t", 1, 0),
            ("stream_all", threads, 0),
            ("stream_1t_prefetch", 1, PREFETCH_BYTES),
            ("stream_all_prefetch", threads, PREFETCH_BYTES),
        ):
            out[name] = lambda t=t, ahead=ahead: ops.read_stream(buf, t, ahead, True)
    return out


def measure(
    nbytes: int = 1 << 30,
    reps: int = 5,
    threads: int | None = None,
    rounds: int = 1,
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> dict:
    """Every method's read bandwidth (GB/s, the median of `reps` timed passes) over one buffer of `nbytes`;
    `rounds` > 1 takes the methods in turn that many times and keeps each one's best round (the machine's drift
    then hits every method). `alloc(nbytes)` gives the buffer (e.g. trtllm_backend.huge_pages.empty)."""
    threads = threads or torch.get_num_threads()
    buf = _buffer(nbytes, alloc)
    readers = _readers(buf, threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for name, fn in readers.items():
                fn()  # warm-up pass
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                best[name] = max(best.get(name, 0.0), buf.numel() / statistics.median(times) / 1e9)
    finally:
        torch.set_num_threads(before)
    method = max(best, key=best.get)
    return {
        "bytes": buf.numel(),
        "threads": threads,
        "reps": reps,
        "rounds": rounds,
        "GBps": best,
        "floor_GBps": best[method],
        "floor_method": method,
    }


def floor_bandwidth(nbytes: int, alloc: Callable[[int], torch.Tensor] | None = None, rounds: int = 2) -> dict:
    """`measure` at a working set of `nbytes` (what a decode step reads): the floor's bandwidth is its floor_GBps."""
    return measure(nbytes, rounds=rounds, alloc=alloc)
