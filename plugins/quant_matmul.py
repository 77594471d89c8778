"""Weight-only quantized linear operators for the INT4/INT8 layer fragments (gpt-fast style, no framework).

Two forms of each weight:
- *portable* (what fragment files hold, platform independent), made by `quantize_int4` / `quantize_int8`:
    INT4: `<p>.qweight` uint8 [out, in/2], two unsigned nibbles per byte (element 2i in the high nibble, 2i+1
          in the low one: torch's CUDA packing convention); `<p>.scales_zeros` bf16 [in/G, out, 2] in the
          gpt-fast convention, w = (q - 8) * scale + zero; optional `<p>.pre_scale` fp32 [in].
    INT8: `<p>.weight` int8 [out, in], symmetric per output channel; `<p>.scales` bf16 [out].
    Q4_1 (a GGUF's own 4-bit blocks, kept exactly: engines/gguf_q4_1.py): `<p>.qweight` as INT4's;
          `<p>.scales_mins` fp16 [out, in/32, 2], each block's scale d and min m as the GGUF stores them,
          w = q * d + m. Run by the same INT4 kernels (int4_pack reads fp16 (d, m) where AWQ gives bf16 (s, z)).
- *platform* (resident, packed for the kernel at load time) inside `Int4Linear` / `Int8Linear`.

AWQ pre-scale (ModelOpt's `pre_quant_scale` convention): y = Q(W / s) @ (x * s). Where the previous op is an
RMSNorm (q|k|v, gate|up) the builder folds s into the norm weight, so the linear has no pre-scale at all;
for o_proj and down_proj it stays here and costs one elementwise multiply of the activations.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from . import cpu_kernels, skinny_gemm

# NOTE: must divide every input dim (SmolLM2's 576 rules out 128). 32 over 64: held-out perplexity with all 30
# layers INT4 (AWQ) 32.0 vs 34.1 (full 30.2) for 11% more INT4 bytes; the kernels run at the same speed.
GROUP_SIZE = 32

# Activations the C++ INT4 decode kernel multiplies the nibbles with (csrc/int4_tile.h): int8 (each row
# quantized per 32 inputs, integer dot products, ~2x the fp32 path's speed) or float32 (exact products).
INT4_ACTIVATIONS = {"int8": 8, "float32": 32}

_LAYER_LINEARS = ("qkv", "o", "gate_up", "down")
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


# ---------------------------------------------------------------- portable INT4 (asymmetric, group-wise)


def quantize_int4(
    weight: Tensor, group_size: int = GROUP_SIZE, pre_scale: Tensor | None = None, prefix: str = ""
) -> dict[str, Tensor]:
    """fp weight [out, in] -> portable INT4 tensors. Quantizes W / pre_scale when a pre-scale is given."""
    out_f, in_f = weight.shape
    if in_f % group_size or in_f % 2:
        raise ValueError(f"group size {group_size} does not divide input dim {in_f}")
    w = weight.detach().to(torch.float32)
    if pre_scale is not None:
        w = w / pre_scale.to(torch.float32)[None, :]
    wg = w.reshape(out_f, in_f // group_size, group_size)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    # Round scale/zero to bf16 *before* choosing q, so q is optimal for the parameters actually stored.
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).to(torch.float32)
    zero = (lo + 8 * scale).to(torch.bfloat16).to(torch.float32)
    q = ((wg - zero) / scale + 8).round().clamp(0, 15).to(torch.uint8).reshape(out_f, in_f)
    sz = torch.stack([scale, zero], -1).reshape(out_f, in_f // group_size, 2).transpose(0, 1)
    out = {
        prefix + "qweight": (q[:, 0::2] << 4) | q[:, 1::2],
        prefix + "scales_zeros": sz.contiguous().to(torch.bfloat16),
    }
    if pre_scale is not None:
        out[prefix + "pre_scale"] = pre_scale.detach().to(torch.float32).contiguous()
    return out


def unpack_int4(qweight: Tensor) -> Tensor:
    """uint8 [out, in/2] -> int32 [out, in] with values 0..15."""
    q = torch.stack([qweight >> 4, qweight & 0xF], -1)
    return q.reshape(qweight.shape[0], -1).to(torch.int32)


def dequantize_int4(tensors: dict[str, Tensor], prefix: str = "") -> Tensor:
    """Effective fp32 weight [out, in] of a portable INT4 weight (pre-scale folded back): the reference."""
    q = unpack_int4(tensors[prefix + "qweight"]).to(torch.float32)
    sz = tensors[prefix + "scales_zeros"].to(torch.float32)
    group_size = q.shape[1] // sz.shape[0]
    scale = sz[..., 0].t().repeat_interleave(group_size, 1)
    zero = sz[..., 1].t().repeat_interleave(group_size, 1)
    w = (q - 8) * scale + zero
    pre = tensors.get(prefix + "pre_scale")
    return w if pre is None else w * pre[None, :]


# ---------------------------------------------------------------- portable Q4_1 (GGUF blocks, kept exactly)

Q4_1_BLOCK = 32  # inputs per GGUF Q4_1 block (one fp16 scale d and min m)


def dequantize_q4_1(tensors: dict[str, Tensor], prefix: str = "") -> Tensor:
    """Effective fp32 weight [out, in] of a portable Q4_1 weight: q * d + m in fp32, which is the GGUF reader's
    dequantization bit for bit (d * q is exact in fp32, so only the sum rounds, once, in both)."""
    q = unpack_int4(tensors[prefix + "qweight"]).to(torch.float32)
    dm = tensors[prefix + "scales_mins"].to(torch.float32)
    group_size = q.shape[1] // dm.shape[1]
    d = dm[..., 0].repeat_interleave(group_size, 1)
    m = dm[..., 1].repeat_interleave(group_size, 1)
    return q * d + m


def is_q4_1(tensors: dict[str, Tensor], prefix: str = "") -> bool:
    return prefix + "scales_mins" in tensors


# ---------------------------------------------------------------- portable INT8 (symmetric, per channel)


def quantize_int8(weight: Tensor, prefix: str = "") -> dict[str, Tensor]:
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8).to(torch.bfloat16).to(torch.float32)
    q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    return {prefix + "weight": q, prefix + "scales": scale.to(torch.bfloat16)}


def dequantize_int8(tensors: dict[str, Tensor], prefix: str = "") -> Tensor:
    return tensors[prefix + "weight"].to(torch.float32) * tensors[prefix + "scales"].to(torch.float32)[:, None]


# ---------------------------------------------------------------- runtime operators


def _bf16_call(fn, x: Tensor, out_features: int) -> Tensor:
    # The CPU int4/int8 kernels are 3-14x slower with fp32 activations than with bf16 ones.
    lead = x.shape[:-1]
    y = fn(x.reshape(-1, x.shape[-1]).to(torch.bfloat16))
    return y.to(torch.float32).reshape(*lead, out_features)


def set_int4_activations(name: str) -> str:
    """Process-wide: the activations of the C++ INT4 decode path (INT4_ACTIVATIONS); returns the previous
    setting. Prefill chunks (dequantize + MKL) and the kernel-less paths are unaffected. No-op without kernels."""
    return _set_kernel_setting("int4_activations", INT4_ACTIVATIONS, name, "int4_activation_bits")


def _set_kernel_setting(what: str, table: dict[str, int], name: str, op: str) -> str:
    """Sets a process-wide kernel setting through its op (which returns the previous code); returns its name."""
    if name not in table:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {name!r}")
    ops = cpu_kernels.ops()
    if ops is None:
        return name
    return _name_of(table, getattr(ops, op)(table[name]))


# Prefill chunks' path in the C++ INT4 kernel (plugins/csrc/int4_linear.cpp): dequantize and multiply with MKL
# in float32 or with bfloat16 inputs and fp32 accumulation (MKL's bf16 GEMM, ~4.4x faster where the CPU has
# AVX512_BF16), or `decode`: the decode tiles, 32 rows at a time, so every prompt row gets the numerics a decode
# row gets (int8 activations per int4_activations; on AVX-512 VNNI 1.3-1.9x faster than the bf16 GEMM at
# 128-512 rows, docs/history/fused-decode.md).
INT4_PREFILL = {"float32": 0, "bfloat16": 1, "decode": 2}


def resolve_int4_prefill(name: str, activations: str) -> str:
    """`auto`: `decode` where the CPU has AVX-512 VNNI and the decode kernel's activations are int8, else bfloat16
    where the CPU has native bf16 dot products, else float32; any other name as given."""
    if name != "auto":
        if name not in INT4_PREFILL:
            raise ValueError(f"int4_prefill must be one of {sorted(INT4_PREFILL)} or auto, got {name!r}")
        return name
    flags = cpu_kernels.cpu_flags() or set()
    if activations == "int8" and cpu_kernels.ops() is not None and {"avx512_vnni", "avx512bw"} <= flags:
        return "decode"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"


def set_int4_prefill(name: str) -> str:
    """Process-wide: the INT4 prefill path (INT4_PREFILL, or "auto": resolve_int4_prefill with the activations in
    force); returns the previous setting. Set the activations first. No-op without kernels."""
    if name == "auto":
        name = resolve_int4_prefill(name, int4_activations_in_force() or "float32")
    return _set_kernel_setting("int4_prefill", INT4_PREFILL, name, "int4_prefill_mode")


def int4_activations_in_force() -> str | None:
    """The INT4 decode kernel's activations in force; None without kernels."""
    ops = cpu_kernels.ops()
    return None if ops is None else _name_of(INT4_ACTIVATIONS, ops.int4_activation_bits(0))


def int4_prefill_in_force() -> str | None:
    """The INT4 prefill path in force; None without kernels."""
    ops = cpu_kernels.ops()
    return None if ops is None else _name_of(INT4_PREFILL, ops.int4_prefill_mode(-1))


def _name_of(table: dict[str, int], code: int) -> str:
    return next(k for k, v in table.items() if v == code)


_decode_kernel_everywhere = False


@contextmanager
def decode_kernel_everywhere():
    """Within: INT4 linears run every input through the decode kernel in chunks of its row limit, never the
    prefill path, so an offline perplexity measures the numerics decode tokens get (tools/eval_quality)."""
    global _decode_kernel_everywhere
    previous, _decode_kernel_everywhere = _decode_kernel_everywhere, True
    try:
        yield
    finally:
        _decode_kernel_everywhere = previous


class Int4Linear:
    """INT4 weight-only linear: y = x @ W^T, fp32 in and out; AWQ's portable form or a GGUF's Q4_1 blocks
    (`q4_1`: fp16 scale and min per block, exactly as the file has them).

    Kernels, by platform:
    - CPU with the project's C++ kernels (plugins/cpu_kernels.py): `morphserve::int4_linear` on the nibbles
      re-laid at load by `int4_pack` (blocks of 8 rows, one per AVX2 lane; the same bytes); decode reads 4.5
      bits per weight with int8 or fp32 activations (set_int4_activations), prefill dequantizes and runs MKL
      in fp32 (about fp32's speed, where torch's int4 kernel is 2.4x slower at 512 rows).
    - CPU without them: torch's `_weight_int4pack_mm_for_cpu`, bf16 activations.
    - CUDA: torch's tinygemm `_weight_int4pack_mm` (untested here).
    Q4_1 runs on the C++ kernels (the same tiles; fp16 d and m where AWQ has bf16 s and z). Without them (or on
    CUDA) no torch op takes fp16 (d, m) exactly, so each call dequantizes (`dequantize_q4_1`) and multiplies in
    fp32: exact, slow, and the resident bytes stay the 4-bit form the memory account counts.
    NOTE: it keeps one resident form of the weight (a platform packing of the nibbles), never two; files are
    written from `quantize_int4`'s dict, the portable form.
    """

    __slots__ = (
        "in_features",
        "out_features",
        "group_size",
        "q4_1",
        "_packed",
        "_scales_zeros",
        "_pre_scale",
        "_mm",
        "_cpp",
        "nbytes",
    )

    def __init__(self, tensors: dict[str, Tensor], prefix: str = ""):
        qweight = tensors[prefix + "qweight"].contiguous()  # its device decides the kernel
        self.q4_1 = is_q4_1(tensors, prefix)
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        pre = tensors.get(prefix + "pre_scale")
        self._pre_scale = None if pre is None else pre.to(torch.float32).contiguous()
        self._cpp = None if qweight.is_cuda else cpu_kernels.ops()
        if self.q4_1:
            dm = tensors[prefix + "scales_mins"].to(torch.float16).contiguous()  # [out, in/G, 2]: the kernel's order
            self.group_size = self.in_features // dm.shape[1]
            if self._cpp is not None:
                self._packed, self._scales_zeros = self._cpp.int4_pack(qweight, dm, self.group_size)
            else:
                self._packed, self._scales_zeros = qweight, dm
            self._mm = None
            self.nbytes = _nbytes(self._packed, self._scales_zeros, self._pre_scale)
            return
        sz = tensors[prefix + "scales_zeros"]
        self.group_size = self.in_features // sz.shape[0]
        self._scales_zeros = sz.to(torch.bfloat16).contiguous()
        if self._cpp is not None:
            # [in/G, out, 2] -> per output row [out, in/G, 2] -> the kernel's blocks of 8 rows
            self._packed, self._scales_zeros = self._cpp.int4_pack(
                qweight, self._scales_zeros.transpose(0, 1).contiguous(), self.group_size
            )
            self._mm = None
        elif qweight.is_cuda:
            # NOTE: untested here (no GPU on the dev machine): gpt-fast's CUDA path. Its layout tiles K by
            # innerKTiles*16; take the largest innerKTiles that divides K (576 allows 4, not 8).
            inner = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            self._packed = torch.ops.aten._convert_weight_to_int4pack(qweight, inner)
            self._mm = torch.ops.aten._weight_int4pack_mm
        else:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight), 1)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        # Resident bytes, counted once: the engine reads every layer's bytes each iteration (morph, invariants).
        self.nbytes = _nbytes(self._packed, self._scales_zeros, self._pre_scale)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str = "") -> "Int4Linear":
        return cls(tensors, prefix)

    @classmethod
    def from_float(cls, weight: Tensor, group_size: int = GROUP_SIZE, pre_scale: Tensor | None = None):
        return cls(quantize_int4(weight, group_size, pre_scale))

    @classmethod
    def fused(cls, weights: list[Tensor], group_size: int = GROUP_SIZE, pre_scale: Tensor | None = None):
        """One operator for row-concatenated projections sharing an input (q|k|v, gate|up)."""
        return cls.from_float(torch.cat(weights, 0), group_size, pre_scale)

    def __call__(self, x: Tensor) -> Tensor:
        if self._cpp is not None:  # the kernel applies the pre-scale itself (one dispatch less)
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features).float()
            if _decode_kernel_everywhere and x2.shape[0] > skinny_gemm.MAX_ROWS:
                y = torch.cat([self._int4_linear(part) for part in x2.split(skinny_gemm.MAX_ROWS)])
            else:
                y = self._int4_linear(x2)
            return y.reshape(*lead, self.out_features)
        if self._pre_scale is not None:
            x = x * self._pre_scale
        if self.q4_1:  # no kernels: exact, dequantized per call (the class docstring says why)
            w = dequantize_q4_1({"qweight": self._packed, "scales_mins": self._scales_zeros})
            return (x.to(torch.float32) @ w.t()).to(x.dtype)
        return _bf16_call(
            lambda a: self._mm(a, self._packed, self.group_size, self._scales_zeros), x, self.out_features
        )

    def _int4_linear(self, x: Tensor) -> Tensor:
        return self._cpp.int4_linear(
            x,
            self._packed,
            self._scales_zeros,
            self._pre_scale,
            self.out_features,
            self.group_size,
            skinny_gemm.MAX_ROWS,
        )

    def resident_tensors(self) -> list[Tensor]:
        """The tensors it holds (for a caller that moves them: `adopt`)."""
        return [t for t in (self._packed, self._scales_zeros, self._pre_scale) if t is not None]

    def adopt(self, tensors: list[Tensor]) -> None:
        """Hold `tensors` instead of `resident_tensors()` (equal copies, same order: e.g. on huge pages)."""
        it = iter(tensors)
        self._packed, self._scales_zeros = next(it), next(it)
        if self._pre_scale is not None:
            self._pre_scale = next(it)

    def fused_args(self) -> tuple[list[Tensor], list[int]] | None:
        """This linear's part of `plugins.decode_layer.decode_layers`' arguments (C++ packing only), else None."""
        if self._cpp is None:
            return None
        pre = self._pre_scale if self._pre_scale is not None else torch.empty(0)
        return [self._packed, self._scales_zeros, pre], [1, self.out_features, self.group_size]


class Int8Linear:
    """INT8 weight-only linear (per-channel scales): the middle rung of the precision ladder."""

    __slots__ = ("in_features", "out_features", "_weight", "_scales")

    def __init__(self, tensors: dict[str, Tensor], prefix: str = ""):
        self._weight = tensors[prefix + "weight"].to(torch.int8).contiguous()
        self._scales = tensors[prefix + "scales"].to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = self._weight.shape

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str = "") -> "Int8Linear":
        return cls(tensors, prefix)

    @classmethod
    def from_float(cls, weight: Tensor) -> "Int8Linear":
        return cls(quantize_int8(weight))

    def __call__(self, x: Tensor) -> Tensor:
        return _bf16_call(
            lambda a: torch.ops.aten._weight_int8pack_mm(a, self._weight, self._scales), x, self.out_features
        )

    @property
    def nbytes(self) -> int:
        return _nbytes(self._weight, self._scales)

    def resident_tensors(self) -> list[Tensor]:
        return [self._weight, self._scales]

    def adopt(self, tensors: list[Tensor]) -> None:
        self._weight, self._scales = tensors


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---------------------------------------------------------------- one decoder layer


def load_quantized_layer(tensors: dict[str, Tensor], meta: dict | None = None) -> dict:
    """A quantized fragment's tensors -> {norms, qkv, o, gate_up, down} for the runtime.

    The kind (int4/int8) is read from the tensor names; `meta` (the manifest entry) is checked when given.
    Norm weights may carry folded AWQ pre-scales: use them as they are.
    """
    is_int4 = "qkv.qweight" in tensors
    cls = Int4Linear if is_int4 else Int8Linear
    layer = {name: tensors[name + ".weight"].to(torch.float32) for name in _LAYER_NORMS}
    layer.update({name: cls.from_tensors(tensors, name + ".") for name in _LAYER_LINEARS})
    if meta and is_int4 and "group_size" in meta and layer["qkv"].group_size != int(meta["group_size"]):
        raise ValueError(f"fragment group size {layer['qkv'].group_size} != manifest {meta['group_size']}")
    return layer


def quantized_layer_nbytes(layer: dict) -> int:
    """Resident bytes of a layer dict from `load_quantized_layer` (norms included)."""
    return sum(v.nbytes for v in layer.values())  # tensors and operators alike have .nbytes


# ---------------------------------------------------------------- micro-benchmark

# SmolLM2's decoder-layer linears as the engine runs them (fused q|k|v and gate|up): (in, out).
SMOLLM2_LAYER = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def read_bandwidth(clock=None) -> float:
    """Bytes/s of a streaming read (sum over a buffer far larger than the caches): the floor's denominator."""
    buf = torch.ones(128 << 20)  # 512 MB
    return buf.numel() * 4 / _median(lambda: buf.sum(), 5, clock)


def _median(fn, reps: int, clock=None) -> float:
    import statistics
    import time

    clock = clock or time.perf_counter
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def layer_benchmark(
    batches=(1, 2, 4, 8, 16, 32), layers: int = 30, reps: int = 9, repeats: int = 3, clock=None
) -> dict:
    """A decoder layer's four linears, full precision stored in fp16 (the skinny kernel) vs INT4, per batch.

    One "pass" runs `layers` distinct layers in turn (30 = SmolLM2: the weights stream from memory, as in
    decode, instead of sitting in the 32 MiB L3). The two kinds alternate pass by pass, `repeats` times,
    with the read bandwidth measured between them; medians are reported, so the machine's noise hits both.
    `clock`: time.perf_counter (wall, the default) or time.process_time (CPU time of the process: on one
    thread it leaves out the time other processes hold the core, which a busy shared machine adds at random).
    """
    from . import skinny_gemm

    torch.manual_seed(0)
    fp16 = [{n: (torch.randn(o, i) * 0.02).half() for n, (i, o) in SMOLLM2_LAYER.items()} for _ in range(layers)]
    int4 = [{n: Int4Linear.from_float(w.float()) for n, w in layer.items()} for layer in fp16]
    per_layer = {
        "fp16": sum(w.numel() * 2 for w in fp16[0].values()),
        "int4": sum(op.nbytes for op in int4[0].values()),
    }
    out = {"bytes_per_layer": per_layer, "bandwidth_GBps": [], "rows": []}

    def pass_of(kind, xs):
        if kind == "fp16":
            return lambda: [skinny_gemm.linear(xs[w.shape[1]], w) for layer in fp16 for w in layer.values()]
        return lambda: [op(xs[op.in_features]) for layer in int4 for op in layer.values()]

    times = {(k, b): [] for k in per_layer for b in batches}
    for _ in range(repeats):
        out["bandwidth_GBps"].append(read_bandwidth(clock) / 1e9)
        for b in batches:
            xs = {576: torch.randn(b, 576), 1536: torch.randn(b, 1536)}
            for kind in per_layer:
                times[kind, b].append(_median(pass_of(kind, xs), reps, clock) / layers)
    import statistics

    bw = statistics.median(out["bandwidth_GBps"]) * 1e9
    for b in batches:
        row = {"batch": b}
        for kind, nbytes in per_layer.items():
            t = statistics.median(times[kind, b])
            row[kind] = {"us": t * 1e6, "GBps": nbytes / t / 1e9, "floor_us": nbytes / bw * 1e6}
        row["fp16_over_int4"] = row["fp16"]["us"] / row["int4"]["us"]
        out["rows"].append(row)
    return out


def main(argv=None) -> int:
    import argparse
    import json
    import time

    ap = argparse.ArgumentParser(
        description="A SmolLM2 layer's linears: fp16-stored full precision vs INT4, per batch."
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=3, help="alternating passes per kind and batch (medians)")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time (use with one thread)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    clock = time.process_time if args.cpu_time else time.perf_counter
    r = layer_benchmark(tuple(args.batches), repeats=args.repeats, clock=clock)
    r["clock"] = clock.__name__
    r["threads"] = torch.get_num_threads()
    bws = r["bandwidth_GBps"]
    print(
        f"threads={torch.get_num_threads()} clock={clock.__name__} group_size={GROUP_SIZE}; one SmolLM2 layer's linears (qkv, o, gate_up, down),"
        f" 30 layers in turn; read bandwidth {sorted(bws)[len(bws) // 2]:.1f} GB/s (runs: {', '.join(f'{b:.1f}' for b in bws)});"
        f" bytes/layer fp16 {r['bytes_per_layer']['fp16'] / 1e6:.2f} MB, int4 {r['bytes_per_layer']['int4'] / 1e6:.2f} MB"
    )
    print(
        f"{'batch':>5} | {'fp16 us':>8} {'floor':>7} {'GB/s':>6} | {'int4 us':>8} {'floor':>7} {'GB/s':>6} | {'fp16/int4':>9}"
    )
    for row in r["rows"]:
        f, q = row["fp16"], row["int4"]
        print(
            f"{row['batch']:>5} | {f['us']:8.1f} {f['floor_us']:7.1f} {f['GBps']:6.1f} | {q['us']:8.1f} {q['floor_us']:7.1f}"
            f" {q['GBps']:6.1f} | {row['fp16_over_int4']:9.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
