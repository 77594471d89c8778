"""The INT8 table: a [rows, dim] weight stored as int8 with one scale per row, used both as a linear (the LM
head: x @ W.T) and as a lookup table (the embedding: W[ids]). It is the quantized form of the tied
embedding / LM head, the unit the morph manager swaps besides the decoder layers.

Portable form (the fragment file): the INT8 layer fragments' format, `quant_matmul.quantize_int8` (symmetric
per output row, `<p>.weight` int8 [rows, dim], `<p>.scales` bf16 [rows]). Resident form: the same int8 bytes
and the scales widened to fp32 (exact).

Dispatch of the linear: the C++ kernel `morphserve::int8_linear` (csrc/int8_linear.cpp) for fp32 CPU batches
up to `skinny_gemm.MAX_ROWS` rows (decode: it reads the int8 bytes once per step, a row's result does not
depend on its batch); otherwise (prefill-sized batches, no kernels, CUDA) the torch reference, which
dequantizes `CHUNK_ROWS` weight rows at a time for MKL so that the transient stays small (9 MB fp32 here).

Activations (`set_head_activations`, process-wide): float32 (the products above), or int8 per Q8_BLOCK inputs
(W8A8: `morphserve::int8_linear_q8`, csrc/int8_linear_q8.cpp, AVX-512 VNNI integer dot products; its torch
twin `reference_linear_q8` for the batches the kernel does not take). `auto`, the default, is int8 where the
CPU runs the VNNI kernel and float32 elsewhere (there the int8 path would only be the slower torch twin).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels, skinny_gemm
from .quant_matmul import quantize_int8

CHUNK_ROWS = 4096
Q8_BLOCK = 64  # inputs per activation scale with int8 activations (csrc/int8_linear_q8.cpp's kQBlock)
HEAD_ACTIVATIONS = ("auto", "int8", "float32")
_int8_activations = False
_tables: "weakref.WeakSet[Int8Table]" = weakref.WeakSet()  # re-laid out when the activations change


def q8_kernel_supported() -> bool:
    """Whether this process can run the VNNI int8-activation kernel (built, loaded, and the CPU has it)."""
    ns = cpu_kernels.ops()
    return ns is not None and hasattr(ns, "int8_linear_q8_supported") and bool(ns.int8_linear_q8_supported())


def head_activations() -> str:
    """The INT8 table's linear activations in force: int8 or float32."""
    return "int8" if _int8_activations else "float32"


def resolve_head_activations(name: str) -> str:
    """`auto`: int8 where the VNNI kernel runs, else float32; int8 and float32 as given."""
    if name not in HEAD_ACTIVATIONS:
        raise ValueError(f"lm_head_activations must be one of {list(HEAD_ACTIVATIONS)}, got {name!r}")
    return "int8" if name == "int8" or (name == "auto" and q8_kernel_supported()) else "float32"


def set_head_activations(name: str) -> str:
    """Process-wide: the INT8 table's linear activations (HEAD_ACTIVATIONS; auto: int8 where the VNNI kernel
    runs, else float32); returns the previous setting, resolved."""
    global _int8_activations
    previous = head_activations()
    _int8_activations = resolve_head_activations(name) == "int8"
    for table in list(_tables):
        table.hold_layout_for_activations()
    return previous


def quantize_activations(x: Tensor, block: int = Q8_BLOCK) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, K / block]): per block absmax / 127, rounded half to even; the
    same float ops as the kernel's quantize_row, so both give the same bytes."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    a = xb.abs().amax(-1)
    inv = torch.where(a > 0, 127 / a, torch.zeros_like(a))
    return torch.round(xb * inv[..., None]).to(torch.int8).reshape(m, k), a / 127


def reference_linear_q8(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """The int8-activation linear in torch: x quantized per Q8_BLOCK inputs, each block's integer dot product
    (exact in fp32: |sum| < 2^24) times its scale, summed over blocks, times the row's scale."""
    q, d = quantize_activations(x)
    m, k = q.shape
    nb = k // Q8_BLOCK
    qb = q.reshape(m, nb, Q8_BLOCK).transpose(0, 1).float()  # [nb, M, B]
    y = torch.empty(m, weight.shape[0], dtype=torch.float32, device=x.device)
    for n0 in range(0, weight.shape[0], CHUNK_ROWS):
        n1 = min(weight.shape[0], n0 + CHUNK_ROWS)
        wb = weight[n0:n1].reshape(n1 - n0, nb, Q8_BLOCK).permute(1, 2, 0).float()  # [nb, B, n]
        y[:, n0:n1] = (torch.bmm(qb, wb) * d.T[:, :, None]).sum(0) * scales[n0:n1].float()
    return y


def reference_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x [M, K] fp32 @ (weight int8 [N, K] * scales [N, 1]).T, chunked over N (the torch path)."""
    n = weight.shape[0]
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    xf = x.float()
    for n0 in range(0, n, CHUNK_ROWS):
        n1 = min(n, n0 + CHUNK_ROWS)
        y[:, n0:n1] = F.linear(xf, weight[n0:n1].float() * scales[n0:n1, None].float())
    return y


def reference_lookup_q8(ids: Tensor, packed: Tensor, scales: Tensor, k: int) -> Tensor:
    """The torch twin of the C++ `int8_lookup_q8`: rows `ids` of the packed layout (`int8_pack_q8`) dequantized,
    fp32 [*ids.shape, k]."""
    flat = ids.reshape(-1)
    rows = packed[flat // 16, :, flat % 16, :].reshape(-1, k).to(torch.int16) - 128
    return (rows.float() * scales[flat].unsqueeze(-1)).reshape(*ids.shape, k)


class Int8Table:
    """int8 rows with fp32 per-row scales; `linear` for the LM head, `lookup` for the embedding.

    The bytes are held once (a second copy broke the engine's memory invariants), in the layout the
    activations in force use: with int8 activations where the VNNI kernel runs, its layout (`int8_pack_q8`: 16
    rows interleaved per 4 inputs), otherwise the row-major rows the fp32 kernel reads. `set_head_activations`
    re-lays out every live table (a copy of the table's bytes, once per change: bench A/B runs, quality
    sweeps), so neither setting runs on the other's layout. Lookups index either layout, and `weight` (the
    row-major rows: tests, the torch twins) is rebuilt from the packed one on each read.
    """

    __slots__ = ("scales", "_rows", "_packed", "_cpp", "_q8", "_shape", "__weakref__")

    def __init__(self, weight: Tensor, scales: Tensor):
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Table: int8 [rows, dim] weight expected, got {weight.dtype} {tuple(weight.shape)}")
        if scales.shape != (weight.shape[0],):
            raise ValueError(f"Int8Table: scales of shape ({weight.shape[0]},) expected, got {tuple(scales.shape)}")
        self.scales = scales.to(torch.float32).contiguous()
        self._shape = weight.shape
        self._cpp = None if weight.is_cuda else cpu_kernels.ops()
        self._q8 = self._cpp is not None and q8_kernel_supported() and weight.shape[1] % Q8_BLOCK == 0
        self._rows, self._packed = weight.contiguous(), None
        self.hold_layout_for_activations()
        _tables.add(self)

    def hold_layout_for_activations(self) -> None:
        """Hold the bytes in the layout the activations in force read (the new form is in place before the old
        is dropped, so a concurrent reader sees one of them)."""
        if _int8_activations and self._q8 and self._packed is None:
            self._packed = self._cpp.int8_pack_q8(self._rows)
            self._rows = None
        elif not _int8_activations and self._rows is None:
            self._rows = self.weight.contiguous()
            self._packed = None

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str = "") -> "Int8Table":
        return cls(tensors[prefix + "weight"], tensors[prefix + "scales"])

    @classmethod
    def from_float(cls, weight: Tensor) -> "Int8Table":
        return cls.from_tensors(quantize_int8(weight))

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def weight(self) -> Tensor:
        """The row-major int8 rows [rows, dim] (rebuilt from the packed layout where that is the one held)."""
        rows, packed = self._rows, self._packed
        if rows is not None:
            return rows
        n, k = self._shape
        return packed.permute(0, 2, 1, 3).reshape(-1, k)[:n].view(torch.int8) ^ torch.tensor(-128, dtype=torch.int8)

    @property
    def nbytes(self) -> int:
        held = sum(t.numel() for t in (self._rows, self._packed) if t is not None)
        return held + self.scales.numel() * 4

    def resident_tensors(self) -> list[Tensor]:
        """The bytes it holds, in the layout held (for a caller that moves them: `adopt`)."""
        return [self._rows if self._rows is not None else self._packed, self.scales]

    def adopt(self, tensors: list[Tensor]) -> None:
        """Hold `tensors` instead of `resident_tensors()` (equal copies, same order: e.g. on huge pages)."""
        held, self.scales = tensors
        if self._rows is not None:
            self._rows = held
        else:
            self._packed = held

    def linear(self, x: Tensor) -> Tensor:
        """x [M, dim] -> fp32 [M, rows]."""
        kernel = self._cpp is not None and x.dim() == 2 and x.dtype == torch.float32
        decode = kernel and x.shape[0] <= skinny_gemm.MAX_ROWS
        rows, packed = self._rows, self._packed
        if _int8_activations and x.shape[-1] % Q8_BLOCK == 0:
            if kernel and packed is not None:  # prefill-sized batches in pieces: each row gets its decode-row result
                if decode:
                    return self._cpp.int8_linear_q8(x, packed, self.scales)
                return torch.cat(
                    [self._cpp.int8_linear_q8(part, packed, self.scales) for part in x.split(skinny_gemm.MAX_ROWS)]
                )
            return reference_linear_q8(x, self.weight, self.scales)
        if decode and rows is not None:
            return self._cpp.int8_linear(x, rows, self.scales)
        return reference_linear(x, self.weight, self.scales)

    def lookup(self, ids: Tensor) -> Tensor:
        """The dequantized rows `ids` (any shape) -> fp32 [*ids.shape, dim]."""
        rows, packed = self._rows, self._packed
        if rows is not None:
            return rows[ids].float() * self.scales[ids].unsqueeze(-1)
        if self._cpp is not None:
            return self._cpp.int8_lookup_q8(ids.long(), packed, self.scales)
        return reference_lookup_q8(ids, packed, self.scales, self._shape[1])

    def dequantize(self) -> Tensor:
        """The effective fp32 weight (tests, quality checks)."""
        return self.weight.float() * self.scales[:, None]
