"""The device under test: its name, its memory bandwidth (the floor's denominator), its peak memory, clean-up."""

from __future__ import annotations

import gc
import platform
import statistics
import time

import torch


def require(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "[gpu_check] no CUDA device here (torch.cuda.is_available() is False); "
            "on a CPU run it as: python -m tools.gpu_check --device cpu --shapes tiny --out DIR"
        )
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"[gpu_check] --device must be cpu or cuda, got {device!r}")


def describe(device: str) -> dict:
    out = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(
            name=torch.cuda.get_device_name(0),
            memory_bytes=p.total_memory,
            cuda=torch.version.cuda,
            capability=f"{p.major}.{p.minor}",
            multiprocessors=p.multi_processor_count,
        )
    else:
        name = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
        out.update(name=name or platform.processor() or "unknown CPU", threads=torch.get_num_threads())
    return out


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, reps: int = 9) -> dict:
    """Bytes moved per second (read + written) by a device-to-device copy of `nbytes`: the median of `reps`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    del src, dst
    release(device)
    med = statistics.median(times)
    return {
        "bytes": nbytes,
        "reps": reps,
        "median_s": med,
        "bytes_per_s": 2 * nbytes / med,
        "GBps": round(2 * nbytes / med / 1e9, 1),
        "method": "dst.copy_(src) on the device; bytes read + bytes written over the median time",
    }


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> dict:
    """Peak device memory since reset_peak (CUDA), or the process's peak resident set (CPU: it cannot be reset)."""
    if device == "cuda":
        return {"peak_device_bytes": torch.cuda.max_memory_allocated()}
    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")), None)
    return {"peak_rss_bytes": rss}


def release(device: str) -> None:
    """Give back what dropped objects held (between engines: one 8B model at a time)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
