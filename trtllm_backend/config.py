"""Engine configuration: one dataclass, its fields grouped by concern (the model and the machine, batching, the
KV cache and memory, kernel numerics, morphing, SLOs, checks), checked at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .controller import parse_forced
from .precision import LM_HEAD_PRECISIONS
from .priority import PRIORITY_MAX, PRIORITY_MIN, is_priority
from .scheduler import check_capacity_policy


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True, kw_only=True)  # keyword-only: the fields are grouped by concern, not by age
class EngineConfig:
    # ---- The model and the machine
    fragment_dir: str
    device: str = "cpu"
    dtype: str = "auto"  # auto: fp32 on CPU (measured fastest here), fp16 on CUDA
    # Storage of the full-precision weights (layers, embedding, LM head); auto: the dtype above. float16 with
    # float32 compute on the CPU halves the bytes a decode step reads (the C++ kernel widens them on load).
    # bfloat16 with float32 compute: the same bytes, and the dense matmuls take bf16 inputs with fp32 sums
    # (plugins/skinny_gemm.py), vLLM-CPU's numerics for them; norms, attention and the residual stay fp32.
    weight_dtype: str = "auto"
    num_threads: int | None = None  # default: all cores
    # Weights and KV segments on 2 MiB pages where the kernel offers transparent huge pages (madvise): fewer TLB
    # misses as a step streams the weights (trtllm_backend/huge_pages.py has the measurement).
    huge_pages: bool = True

    # ---- Batching and the queue
    max_batch_size: int = 32
    max_num_tokens: int = 512  # tokens computed per iteration (prefill is chunked to fit)
    max_queue_size: int = 256
    max_model_len: int | None = None  # default: the model's context length
    # A step that carries decodes takes at most this share of tpot_slo_s: prefill chunks are cut to fit, from the
    # measured cost of a token (trtllm_backend/step_budget.py). 0: every step may fill max_num_tokens.
    prefill_chunk_tpot_share: float = 0.5

    # ---- The KV cache and the memory budget
    block_size: int = 16
    max_tokens_in_paged_kv_cache: int = 8192  # the KV pool at full precision, in tokens
    # Storage of the paged KV cache; auto: the compute dtype. float16 beside float32 compute halves each block's
    # bytes (twice the tokens in the same memory, and in the memory a swapped layer frees) and what a decode
    # step's attention reads; K/V are rounded to fp16 when written and widened exactly when read.
    kv_cache_dtype: str = "auto"
    # Bound on everything resident (weights, fragments being staged, KV), whichever policy runs. Default: the
    # full-precision model plus max_tokens_in_paged_kv_cache tokens of KV. Every byte a policy does not spend on
    # weights is KV, except a dynamic policy's staging reserve, which comes out of the budget (not on top of it).
    memory_budget_bytes: int | None = None
    # Automatic prefix caching (trtllm_backend/prefix_cache.py): full KV blocks are cached by their tokens and
    # everything before them, and a request reuses the longest cached prefix instead of prefilling it. On by
    # default (as vLLM and TensorRT-LLM users expect): KV is reused only under the weights that computed it.
    enable_prefix_caching: bool = True
    # Reuse cached KV whatever units were bound quantized when it was computed. On: a swap keeps the cache, the
    # approximation morphing already makes for the KV of the requests running through a swap (a static policy
    # never swaps, so it is exact either way). Off: a swap starts the cache anew (a prefix is reused only under the
    # weights that computed it), and every swap re-prefills the conversations it held.
    kv_cache_reuse_across_morphs: bool = True
    # Who gets KV when the pool is short (TensorRT-LLM's batch_scheduler_policy; trtllm_backend/scheduler.py):
    # max_utilization admits on the next chunk and preempts (recompute) when running requests outgrow the pool;
    # guaranteed_no_evict admits only what can run to prompt + max_tokens beside everything running.
    batch_scheduler_policy: str = "max_utilization"

    # ---- Kernel numerics (each engine's own: trtllm_backend/kernel_numerics.py)
    # Activations of the C++ INT4 decode kernel (plugins/quant_matmul.INT4_ACTIVATIONS): int8 (per-32 absmax,
    # ~2x faster) or float32.
    int4_activations: str = "int8"
    # Prefill chunks' path in INT4 layers (plugins/quant_matmul.INT4_PREFILL): decode (the decode tiles, 32 rows
    # at a time: the numerics of decode rows, faster than the bf16 GEMM on AVX-512 VNNI), bfloat16 inputs (fp32
    # accumulation; MKL's bf16 GEMM, ~4x faster with AVX512_BF16), float32, or auto (decode where the CPU has
    # AVX-512 VNNI and int4_activations is int8, else bfloat16 where it has native bf16).
    int4_prefill: str = "auto"
    # Activations of the INT8 LM head (plugins/int8_linear.HEAD_ACTIVATIONS) once that unit is morphed: int8 per
    # 64 inputs (W8A8, AVX-512 VNNI; ~2.5x faster at 16 rows, +0.10% perplexity), float32, or auto (int8 where
    # the CPU runs the VNNI kernel).
    lm_head_activations: str = "auto"

    # ---- Morphing
    morph_policy: str = "balanced"  # accuracy | balanced | performance | full | int4 | int4:N
    # The tied embedding / LM head: full; int8 (its INT8 fragment bound at load whatever the policy: quality-neutral,
    # results/quality/quality.json, and its freed bytes are KV); or dynamic (a morph unit swapped like a layer: a
    # dynamic policy then keeps room to stage the INT8 table, ~13x an INT4 layer's).
    lm_head_precision: str = "full"
    morph_overrides: dict = field(default_factory=dict)  # threshold name -> value (see controller.MorphPolicy)
    # The request priorities whose queue drives morphing (SamplingParams.priority, lower is more important): the
    # controller sees the waiting requests and preemptions of priorities <= this; less important ones are
    # served with what those leave. Default: every class.
    morph_priority_cutoff: int = PRIORITY_MAX
    # Morph actions at given engine iterations, "down:K@ITER,up:K@ITER" (benchmarks, tests): they run whatever
    # the policy, after any action in flight. Empty: the MORPHSERVE_FORCE_MORPH environment variable (a test hook).
    force_morph: str = ""

    # ---- The deployment's SLOs (they drive morphing and the prefill chunk size)
    # The deployment's TPOT SLO in seconds (0: none). A dynamic policy then also morphs when decode is slow with
    # requests waiting (controller.TPOT_PRESSURE_SHARE of it), where INT4 was measured faster at load. The
    # default is the SLO the capacity reports hold this CPU to (tools/capacity/slo.py).
    tpot_slo_s: float = 0.35
    # The deployment's TTFT SLO in seconds (0: none). The performance policy (controller.QUEUEING_MODES) then also
    # morphs when the head of the queue has waited longer than controller.TTFT_PRESSURE_SHARE of it with the KV
    # cache not short (the step, not the memory, is the limit), where INT4 was measured faster at load; the other
    # dynamic policies with morph_down_ttft_s set. Default: the capacity reports' SLO.
    ttft_slo_s: float = 2.0

    # ---- Checks
    # Check the state invariants (trtllm_backend/invariants.py) after every iteration's morph step; a violation
    # is counted (EngineStats.invariant_violations) and logged with the state. Cheap enough to leave on.
    check_invariants: bool = True

    def __post_init__(self):
        for name in (
            "block_size",
            "max_batch_size",
            "max_num_tokens",
            "max_tokens_in_paged_kv_cache",
            "max_queue_size",
        ):
            _positive(name, getattr(self, name))
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.max_tokens_in_paged_kv_cache < self.block_size:
            raise ValueError("max_tokens_in_paged_kv_cache must hold at least one block")
        for name in ("enable_prefix_caching", "kv_cache_reuse_across_morphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_capacity_policy(self.batch_scheduler_policy)
        cutoff = self.morph_priority_cutoff
        if not is_priority(cutoff):
            raise ValueError(
                f"morph_priority_cutoff must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {cutoff!r}"
            )
        if self.memory_budget_bytes is not None:
            _positive("memory_budget_bytes", self.memory_budget_bytes)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weight_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"weight_dtype must be auto, float32, float16 or bfloat16, got {self.weight_dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.int4_prefill not in ("auto", "decode", "float32", "bfloat16"):
            raise ValueError(f"int4_prefill must be auto, decode, float32 or bfloat16, got {self.int4_prefill!r}")
        if self.lm_head_activations not in ("auto", "int8", "float32"):
            raise ValueError(f"lm_head_activations must be auto, int8 or float32, got {self.lm_head_activations!r}")
        if self.lm_head_precision not in LM_HEAD_PRECISIONS:
            raise ValueError(
                f"lm_head_precision must be one of {', '.join(LM_HEAD_PRECISIONS)}, got {self.lm_head_precision!r}"
            )
        if self.int4_activations not in ("int8", "float32"):
            raise ValueError(f"int4_activations must be int8 or float32, got {self.int4_activations!r}")
        for name in ("tpot_slo_s", "ttft_slo_s"):
            slo = getattr(self, name)
            if not (isinstance(slo, (int, float)) and 0 <= slo < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0 (0: no {name[:4].upper()} SLO), got {slo!r}")
        share = self.prefill_chunk_tpot_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(
                f"prefill_chunk_tpot_share must be in [0, 1] (0: chunks fill max_num_tokens), got {share!r}"
            )
        parse_forced(self.force_morph, "force_morph")  # a typo fails here, not at the iteration it names
        w, c = self.weight_torch_dtype, self.torch_dtype
        if w != c and not (w in (torch.float16, torch.bfloat16) and c == torch.float32):
            raise ValueError(
                f"weight_dtype={self.weight_dtype} with dtype={self.dtype}: weights are stored in the "
                "compute dtype, or in float16 or bfloat16 under float32 compute"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # NOTE: on this AVX2 CPU fp32 matmuls beat bf16 for SmolLM2's shapes (tools/bench_engine.py shows
            # both); on CUDA fp16 is the native full precision.
            return torch.float16 if self.device == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    @property
    def weight_torch_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.weight_dtype == "auto" else getattr(torch, self.weight_dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else getattr(torch, self.kv_cache_dtype)

    @property
    def base_kv_blocks(self) -> int:
        return self.max_tokens_in_paged_kv_cache // self.block_size

    def forced_morph_actions(self) -> dict:
        """force_morph, or else the MORPHSERVE_FORCE_MORPH test hook, as controller actions by iteration."""
        if self.force_morph:
            return parse_forced(self.force_morph, "force_morph")
        return parse_forced(os.environ.get("MORPHSERVE_FORCE_MORPH", ""))

    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1
