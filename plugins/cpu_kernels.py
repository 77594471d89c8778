"""The project's C++ CPU kernels (plugins/csrc/): build them once, load them, say plainly when they are absent.

- `morphserve::skinny_linear` (skinny_gemm.cpp): fp32 y = x @ W.T for decode batches (plugins/skinny_gemm.py).
- `morphserve::bf16_linear` (bf16_linear.cpp): y = x @ W.T with bf16 weights and bf16 inputs, fp32 accumulation
  (AVX512_BF16), for decode batches under weight_dtype=bfloat16 (plugins/skinny_gemm.py).
- `morphserve::paged_decode_attention` and `paged_decode_attention_qkv` (paged_decode_attention.cpp): decode
  attention read in place from the KV pool's segments; the second also applies RoPE and writes the new K/V
  (plugins/paged_attention.py).
- `morphserve::int4_linear` / `int4_dequantize` (int4_linear.cpp): INT4 fragments with fp32 activations
  (plugins/quant_matmul.py).
- `morphserve::rms_norm`, `add_rms_norm`, `silu_mul`, `rope_heads` (layer_elementwise.cpp): a layer's row-wise
  ops (plugins/elementwise.py).
- `morphserve::argmax_rows` (argmax_rows.cpp): greedy sampling's argmax per row (plugins/argmax.py).
- `morphserve::apply_token_bitmask_` (token_bitmask.cpp): structured outputs' allowed-token masks applied to the
  logits in place (plugins/token_bitmask.py).
- `morphserve::read_stream` (read_stream.cpp): a plain streaming read, the read-bandwidth floor's best method
  (plugins/read_bandwidth.py).
- `morphserve::decode_layers` (decode_layer.cpp): the decoder layers of a pure decode step in one call, one
  OpenMP region with barriers between phases, on the same inner loops as the ops above (plugins/decode_layer.py).

They are compiled with the platform's C++ compiler into `build/kernels/` by `python -m plugins.cpu_kernels`
(the set-up step runs it; a no-op when up to date). Where they are not built, cannot be loaded, or the CPU
lacks AVX2/FMA/F16C, callers fall back to the torch ops and one log line says why. `MORPHSERVE_CPU_KERNELS=0`
turns them off (the torch reference path); `MORPHSERVE_KERNELS_LIBRARY=PATH` loads another build instead
(comparing builds: tools/kernel_builds_ab.py, tools/microbench/).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [
    CSRC / "skinny_gemm.cpp",
    CSRC / "bf16_linear.cpp",
    CSRC / "paged_decode_attention.cpp",
    CSRC / "int4_linear.cpp",
    CSRC / "layer_elementwise.cpp",
    CSRC / "decode_layer.cpp",
    CSRC / "int8_linear.cpp",
    CSRC / "int8_linear_q8.cpp",
    CSRC / "argmax_rows.cpp",
    CSRC / "read_stream.cpp",
    CSRC / "token_bitmask.cpp",
]
BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "kernels"
LIBRARY_NAME = "morphserve_kernels"
_ops: dict[str, object] = {}  # "ns": the torch.ops namespace, or None when unusable (decided once)
_lock = threading.Lock()


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (/proc/cpuinfo), or None where they cannot be read."""
    try:
        return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None


def unsupported_reason() -> str | None:
    """None when this CPU can run the kernels, else why not."""
    flags = cpu_flags()
    if flags is None:
        return "cannot read /proc/cpuinfo"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def library_path() -> Path:
    return BUILD_DIR / f"{LIBRARY_NAME}.so"


def library_to_load() -> Path:
    """The build ops() loads: MORPHSERVE_KERNELS_LIBRARY where set, else the one in BUILD_DIR."""
    return Path(os.environ.get("MORPHSERVE_KERNELS_LIBRARY") or library_path())


def build(verbose: bool = False) -> Path:
    """Compile the kernels into BUILD_DIR (a no-op when up to date) and return the library's path."""
    from torch.utils import cpp_extension

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # NOTE: torch rebuilds only when a source file or a flag changed, not a header: the headers' hash goes in
    # as a define, so editing one rebuilds too.
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))).hexdigest()[:16]
    cpp_extension.load(
        name=LIBRARY_NAME,
        sources=[str(s) for s in SOURCES],
        build_directory=str(BUILD_DIR),
        is_python_module=False,
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", f"-DMORPHSERVE_HEADERS={headers}"],
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )
    return library_path()


def ops():
    """`torch.ops.morphserve` once the library is loaded, or None (logged once) when the kernels are unusable."""
    if "ns" in _ops:
        return _ops["ns"]
    with _lock:
        if "ns" in _ops:
            return _ops["ns"]
        ns, why = None, None
        if os.environ.get("MORPHSERVE_CPU_KERNELS", "1") == "0":
            why = "MORPHSERVE_CPU_KERNELS=0"
        else:
            why = unsupported_reason()
        lib = library_to_load()
        if why is None and not lib.exists():
            why = f"{lib} is not built (python -m plugins.cpu_kernels)"
        if why is None:
            try:
                torch.ops.load_library(str(lib))
                ns = torch.ops.morphserve
            except (OSError, RuntimeError) as e:
                why = f"cannot load {lib}: {e}"
        if why:
            log.warning("C++ CPU kernels not in use, decode runs on torch ops (MKL matmuls, SDPA): %s", why)
        _ops["ns"] = ns
        return ns


def main(argv=None) -> int:
    import argparse
    import time

    ap = argparse.ArgumentParser(description="Build the C++ CPU kernels into build/kernels/ (no-op when up to date).")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if (why := unsupported_reason()) is not None:
        print(f"[kernels] not built: {why}; decode runs on torch ops")
        return 0
    t = time.perf_counter()
    print("[kernels] building the C++ CPU kernels (a no-op when up to date) ...", flush=True)
    path = build(args.verbose)
    print(f"[kernels] {path.name} ready in build/kernels/ ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
