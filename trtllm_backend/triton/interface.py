"""The model's Triton interface: one table of inputs under both of TensorRT-LLM's name sets, decoded into one
request, and the outputs each response carries.

TensorRT-LLM had two Triton backends: the TensorRT-engine one (`inflight_batcher_llm`, removed in July 2026,
its PR #15907), whose names genai-perf `--backend tensorrtllm` and the vLLM serving benchmark send, and the
LLM-API Python backend (`triton_backend/all_models/llmapi/`) that remains. Each input row carries its name in
either set (or both); one decoder reads them all, so there is no second code path. Every input the LLM-API
backend defines is served or refused by name (LoRA, images, named logits processors are refused).

Used by model.py, by tests, and to generate the tables of docs/configuration.md
(`python -m trtllm_backend.triton.interface`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidRequest
from ..logprobs import TokenLogprob
from ..outputs import KVReuse, RequestOutput, RequestTimings
from ..sampling import SamplingParams
from ..structured import Guide


@dataclass(frozen=True, slots=True)
class InputSpec:
    trtllm: str | None  # the TensorRT-engine backend's name (or this model's own addition)
    llmapi: str | None  # the LLM-API backend's name
    kind: str  # "text", "texts", "int", "float" or "bool"
    dtype: str  # config.pbtxt data type
    field: str | None = None  # the SamplingParams field it sets; None: read by the glue under `key`
    doc: str = ""
    refused: str | None = None  # accepted by Triton only so the model can refuse it by name, saying why

    @property
    def key(self) -> str:
        return self.trtllm or self.llmapi

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for n in (self.trtllm, self.llmapi) if n))

    @property
    def dims(self) -> str:
        return "-1" if self.kind == "texts" else "1"


def _in(trtllm, llmapi, kind, dtype, field=None, doc="", refused=None) -> InputSpec:
    return InputSpec(trtllm, llmapi, kind, dtype, field, doc, refused)


S, I32, U64, F32, B = "TYPE_STRING", "TYPE_INT32", "TYPE_UINT64", "TYPE_FP32", "TYPE_BOOL"
INPUTS = (
    _in("text_input", "text_input", "text", S, doc="The prompt, raw UTF-8 text (no chat template is applied)."),
    _in(
        "max_tokens",
        "sampling_param_max_tokens",
        "int",
        I32,
        "max_tokens",
        "Most tokens to generate (default: `default_max_tokens`).",
    ),
    _in("stream", "streaming", "bool", B, doc="true: a response every token as it is made; false: one final response."),
    _in(
        "temperature",
        "sampling_param_temperature",
        "float",
        F32,
        "temperature",
        "0 = greedy (default: `default_temperature`).",
    ),
    _in("top_k", "sampling_param_top_k", "int", I32, "top_k", "0 = no cut (default: `default_top_k`)."),
    _in("top_p", "sampling_param_top_p", "float", F32, "top_p", "In (0, 1] (default: `default_top_p`)."),
    _in(
        "random_seed",
        "sampling_param_seed",
        "int",
        U64,
        "seed",
        "Seed of this request's sampler (reproducible sampling).",
    ),
    _in("seed", None, "int", U64, "seed", "The same, under the name of Triton's OpenAI frontend."),
    _in(
        "frequency_penalty",
        "sampling_param_frequency_penalty",
        "float",
        F32,
        "frequency_penalty",
        "In [-2, 2]: each logit lowered by this times the token's count in the output so far (OpenAI's rule).",
    ),
    _in(
        "presence_penalty",
        "sampling_param_presence_penalty",
        "float",
        F32,
        "presence_penalty",
        "In [-2, 2]: each logit of a token already in the output lowered by this.",
    ),
    _in(
        "stop_words",
        "sampling_param_stop",
        "texts",
        S,
        "stop",
        "Strings that end the output (not included); empty entries are ignored.",
    ),
    _in(
        "exclude_input_in_output",
        "sampling_param_exclude_input_from_output",
        "bool",
        B,
        doc="false: the output starts with the prompt. Default: `stream` under the TensorRT-engine names, true under "
        "the LLM-API names (the LLM API's text is the generated text).",
    ),
    _in(
        "min_length",
        None,
        "int",
        I32,
        "min_tokens",
        "End-of-sequence and stop words are ignored before this many tokens.",
    ),
    _in("beam_width", None, "int", I32, doc="Accepted for TensorRT-LLM clients; only 1 is supported."),
    _in(
        "priority",
        None,
        "int",
        I32,
        "priority",
        "In [-10, 10], lower is more important (vLLM's `priority`): admitted first, preempted last (default 0).",
    ),
    _in(None, "sampling_param_best_of", "int", I32, doc="Accepted for LLM-API clients; only 1 is supported."),
    _in(
        "return_log_probs",
        None,
        "bool",
        B,
        doc="true: `output_log_probs` and `cum_log_probs` (log_softmax of the raw "
        "logits, before penalties, temperature, top-k/p and masks).",
    ),
    _in(
        "top_logprobs",
        None,
        "int",
        I32,
        doc="In [0, 20]: also the this many most likely tokens of each position "
        "(`output_top_logprobs`, `output_top_ids`); implies `return_log_probs`.",
    ),
    _in(
        "return_prompt_log_probs",
        None,
        "bool",
        B,
        doc="true: the prompt tokens' logprobs too (`prompt_ids`, "
        "`prompt_log_probs`, and with `top_logprobs` the alternatives), on the first response.",
    ),
    _in(
        "guided_decoding_guide_type",
        None,
        "text",
        S,
        doc="Structured output: `json` (any JSON object), `json_schema`, "
        "`regex` or `ebnf_grammar` (GBNF or Lark; `lark` is the same); the output is constrained to match "
        "`guided_decoding_guide`.",
    ),
    _in(
        "guided_decoding_guide",
        None,
        "text",
        S,
        doc="The schema (JSON text), regular expression or grammar; not needed for `json`.",
    ),
    _in(None, "return_finish_reason", "bool", B, doc="Accepted: `finish_reason` is always returned."),
    _in(None, "return_stop_reason", "bool", B, doc="true: `stop_reason`, the stop string that ended the output."),
    _in(None, "return_cumulative_logprob", "bool", B, doc="true: `cumulative_logprob` of the generated tokens."),
    _in(
        None,
        "sampling_param_return_perf_metrics",
        "bool",
        B,
        doc="true: the KV reuse counts, the request's timing (`*_time_ns`) and the draft-token counts.",
    ),
    _in(
        "stop",
        "stop",
        "bool",
        B,
        doc="true: cancel the in-flight request with the same request id (no `text_input` needed).",
    ),
    _in(None, "lora_id", "int", U64, refused="LoRA adapters are not supported"),
    _in(None, "lora_name", "text", S, refused="LoRA adapters are not supported"),
    _in(None, "lora_path", "text", S, refused="LoRA adapters are not supported"),
    _in(None, "lora_ckpt_source", "text", S, refused="LoRA adapters are not supported"),
    _in(None, "image_url", "texts", S, refused="the model is text-only"),
    _in(
        None, "sampling_param_logits_post_processor_name", "text", S, refused="no logits post-processors are configured"
    ),
)
BY_NAME = {name: spec for spec in INPUTS for name in spec.names}
LLMAPI_ONLY = frozenset(s.llmapi for s in INPUTS if s.llmapi and s.llmapi != s.trtllm)
# Engine/SamplingParams field -> the TensorRT-engine input name, so an engine error names an input.
INPUT_OF_FIELD = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "random_seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "min_tokens": "min_length",
    "stop": "stop_words",
    "logprobs": "top_logprobs",
    "prompt_logprobs": "top_logprobs",
    "prompt": "text_input",
    "text": "text_input",
    "guide": "guided_decoding_guide",
    "priority": "priority",
}
# guided_decoding_guide_type -> the engine's Guide type (TensorRT-LLM's names; structural_tag is not served)
GUIDE_TYPES = {
    "json": "json",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf_grammar": "grammar",
    "lark": "grammar",
}


def _bad(name: str, message: str) -> InvalidRequest:
    return InvalidRequest(name, message)


def _utf8(name: str, value) -> str:
    if not isinstance(value, bytes):
        raise _bad(name, f"must be BYTES, got {type(value).__name__}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(name, "is not valid UTF-8") from None


def decode_input(name: str, kind: str, array: np.ndarray):
    """One input tensor -> a Python value. Tolerant of shape ([1], [1, 1]) and of int/float widths;
    strict about meaning (an integer field rejects 2.5, a boolean rejects 7)."""
    if kind == "texts":
        if array.dtype != np.object_:
            raise _bad(name, f"must be BYTES, got {array.dtype}")
        return [w for w in (_utf8(name, v) for v in array.reshape(-1)) if w]  # empty entries are padding
    if array.size != 1:
        raise _bad(name, f"must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if kind == "text":
        text = _utf8(name, value)
        if not text:
            raise _bad(name, "must not be empty")
        return text
    if kind == "bool":
        if array.dtype == np.bool_ or (np.issubdtype(array.dtype, np.integer) and value in (0, 1)):
            return bool(value)
        raise _bad(name, f"must be a boolean, got {value!r} ({array.dtype})")
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise _bad(name, f"must be numeric, got {array.dtype}")
    number = value.item()
    if not math.isfinite(number):
        raise _bad(name, f"must be finite, got {number!r}")
    if kind == "int":
        if isinstance(number, float) and not number.is_integer():
            raise _bad(name, f"must be an integer, got {number!r}")
        return int(number)
    return float(number)


@dataclass(frozen=True, slots=True)
class Returns:
    """What a request asked its responses to carry beyond the always-sent outputs."""

    cumulative_text: bool = False  # LLM-API streaming: each response holds the whole text so far
    log_probs: bool = False
    top_logprobs: int = 0
    prompt_log_probs: bool = False
    stop_reason: bool = False
    cumulative_logprob: bool = False
    perf_metrics: bool = False


@dataclass(slots=True)
class Decoded:
    prompt: str | None
    params: SamplingParams | None
    stream: bool
    exclude_input: bool
    stop: bool
    returns: Returns = field(default_factory=Returns)


def decode_request(arrays: dict[str, np.ndarray], defaults: dict) -> Decoded:
    """The request's input tensors (by name) -> a Decoded request, or InvalidRequest naming the input."""
    fields: dict[str, object] = {}  # SamplingParams field -> value
    flags: dict[str, object] = {}  # spec key -> value, for the inputs the glue reads
    given: dict[tuple[bool, str], str] = {}  # (is a field, field or key) -> the input name that set it
    for name, array in arrays.items():
        spec = BY_NAME.get(name)
        if spec is None:
            raise _bad(name, "unknown input")  # Triton refuses undeclared inputs first; fakes and tests may not
        if spec.refused:
            raise _bad(name, f"not supported: {spec.refused}")
        value = decode_input(name, spec.kind, array)
        target, slot = (fields, spec.field) if spec.field else (flags, spec.key)
        if slot in target and target[slot] != value:
            raise _bad(name, f"differs from {given[bool(spec.field), slot]}: give one of them")
        target[slot], given[bool(spec.field), slot] = value, name
    llmapi = any(name in LLMAPI_ONLY for name in arrays)
    stream = bool(flags.get("stream", False))
    if flags.get("stop", False):  # a cancel request: nothing else matters
        return Decoded(None, None, stream, True, True)
    if "text_input" not in flags:
        raise _bad("text_input", "is required")
    for key in ("beam_width", "sampling_param_best_of"):
        if flags.get(key, 1) != 1:
            raise _bad(key, f"only 1 is supported, got {flags[key]}")
    returns = Returns(
        cumulative_text=llmapi and stream,
        log_probs=bool(flags.get("return_log_probs")) or "top_logprobs" in flags,
        top_logprobs=int(flags.get("top_logprobs", 0)),
        prompt_log_probs=bool(flags.get("return_prompt_log_probs")),
        stop_reason=bool(flags.get("return_stop_reason")),
        cumulative_logprob=bool(flags.get("return_cumulative_logprob")),
        perf_metrics=bool(flags.get("sampling_param_return_perf_metrics")),
    )
    sampling = dict(defaults) | fields
    if "guided_decoding_guide_type" in flags:
        kind = flags["guided_decoding_guide_type"]
        if kind not in GUIDE_TYPES:
            raise _bad("guided_decoding_guide_type", f"must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
        sampling["guide"] = Guide(GUIDE_TYPES[kind], flags.get("guided_decoding_guide", ""))
    elif "guided_decoding_guide" in flags:
        raise _bad("guided_decoding_guide", "needs guided_decoding_guide_type")
    if returns.log_probs or returns.cumulative_logprob:
        sampling["logprobs"] = returns.top_logprobs
    if returns.prompt_log_probs:
        sampling["prompt_logprobs"] = returns.top_logprobs
    # NOTE: as in the TensorRT-engine backend a streamed response carries only new text and a single response
    # echoes the prompt unless asked not to; the LLM API's text is the generated text unless asked otherwise.
    exclude = flags.get("exclude_input_in_output", True if llmapi else stream)
    return Decoded(flags["text_input"], SamplingParams(**sampling), stream, exclude, False, returns)


# --- outputs ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OutputSpec:
    name: str
    dtype: str
    dims: str  # config.pbtxt dims after the batch dimension
    doc: str


OUTPUTS = (
    OutputSpec(
        "text_output",
        S,
        "-1",
        "The text of this response: the new text when streaming (the whole text so far "
        "under the LLM-API names), the whole output otherwise.",
    ),
    OutputSpec("output_token_count", I32, "1", "Tokens in this response."),
    OutputSpec(
        "int4_layers",
        I32,
        "-1",
        "For each of those tokens, how many decoder layers ran quantized (INT4) when it was made.",
    ),
    OutputSpec("prompt_token_count", I32, "1", "The prompt's tokens as the engine counted them."),
    OutputSpec(
        "prompt_cached_token_count",
        I32,
        "1",
        "Of those, the tokens whose KV came from the prefix cache (not prefilled).",
    ),
    OutputSpec(
        "finish_reason",
        S,
        "1",
        "`stop` (end of sequence or a stop word) or `length` on the final response; empty before it.",
    ),
    OutputSpec("output_ids", I32, "-1", "With log probs: this response's token ids."),
    OutputSpec("output_log_probs", F32, "-1", "With log probs: each token's logprob."),
    OutputSpec("cum_log_probs", F32, "1", "With log probs: their sum over the whole output so far."),
    OutputSpec(
        "output_top_logprobs", F32, "-1, -1", "With top_logprobs k: [tokens, k] logprobs of the most likely tokens."
    ),
    OutputSpec("output_top_ids", I32, "-1, -1", "With top_logprobs k: their token ids."),
    OutputSpec("prompt_ids", I32, "-1", "With prompt log probs (first response): the prompt's token ids."),
    OutputSpec("prompt_log_probs", F32, "-1", "Their logprobs (NaN for the first token: it has no context)."),
    OutputSpec("prompt_top_logprobs", F32, "-1, -1", "With top_logprobs k: [prompt tokens, k] (NaN for the first)."),
    OutputSpec("prompt_top_ids", I32, "-1, -1", "Their token ids (-1 for the first)."),
    OutputSpec("stop_reason", S, "1", "With return_stop_reason: the stop string that ended the output, else empty."),
    OutputSpec("cumulative_logprob", F32, "1", "With return_cumulative_logprob: the generated tokens' summed logprob."),
    OutputSpec(
        "kv_cache_reused_block", I32, "1", "Perf metrics: prompt KV blocks found in a cache (0: no prefix cache yet)."
    ),
    OutputSpec("kv_cache_missed_block", I32, "1", "Perf metrics: prompt KV blocks computed."),
    OutputSpec("kv_cache_alloc_new_blocks", I32, "1", "Perf metrics: KV blocks allocated for this request."),
    OutputSpec("kv_cache_alloc_total_blocks", I32, "1", "Perf metrics: KV blocks it holds."),
    OutputSpec("kv_cache_hit_rate", F32, "1", "Perf metrics: reused / prompt blocks."),
    OutputSpec(
        "arrival_time_ns",
        "TYPE_INT64",
        "1",
        "Perf metrics: arrival, CLOCK_MONOTONIC nanoseconds (as the LLM API's steady clock).",
    ),
    OutputSpec("first_scheduled_time_ns", "TYPE_INT64", "1", "Perf metrics: first schedule (0: not yet)."),
    OutputSpec("first_token_time_ns", "TYPE_INT64", "1", "Perf metrics: first token (0: not yet)."),
    OutputSpec("last_token_time_ns", "TYPE_INT64", "1", "Perf metrics: latest token (0: not yet)."),
    OutputSpec("acceptance_rate", F32, "1", "Perf metrics: speculative decoding's; 0 (none here)."),
    OutputSpec("total_accepted_draft_tokens", I32, "1", "Perf metrics: 0 (no speculative decoding)."),
    OutputSpec("total_draft_tokens", I32, "1", "Perf metrics: 0 (no speculative decoding)."),
)


@dataclass(slots=True)
class Piece:
    """What one response reports: one engine output (streaming) or all of them joined (a single response)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    int4_layers: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    cumulative_logprob: float | None = None
    timings: RequestTimings | None = None
    kv_reuse: KVReuse | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.int4_layers += out.int4_layers
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ids = out.prompt_logprobs, out.prompt_token_ids
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.finish_reason = out.finish_reason if out.finished else None
        self.stop_reason = out.stop_reason
        self.cumulative_logprob = out.cumulative_logprob
        self.timings = out.timings
        self.kv_reuse = out.kv_reuse


def _row(values, dtype) -> np.ndarray:
    return np.array([values], dtype=dtype).reshape(1, -1)


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def _top(entries: list[TokenLogprob | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    values = np.full((1, len(entries), k), np.nan, dtype=np.float32)
    ids = np.full((1, len(entries), k), -1, dtype=np.int32)
    for i, e in enumerate(entries):
        for j, (token, lp) in enumerate(e.top if e is not None else ()):
            ids[0, i, j], values[0, i, j] = token, lp
    return values, ids


def _ns(t: float | None) -> int:
    return int(t * 1e9) if t is not None else 0


def response_outputs(piece: Piece, returns: Returns, total_output_tokens: int | None = None) -> dict[str, np.ndarray]:
    """The output tensors of one response (name -> array with the batch dimension of 1)."""
    out = {
        "text_output": _scalar(piece.text.encode("utf-8"), np.object_),
        "output_token_count": _scalar(
            total_output_tokens if total_output_tokens is not None else len(piece.token_ids), np.int32
        ),
        "int4_layers": _row(piece.int4_layers, np.int32),
        "prompt_token_count": _scalar(piece.num_prompt_tokens, np.int32),
        "prompt_cached_token_count": _scalar(piece.kv_reuse.reused_tokens if piece.kv_reuse else 0, np.int32),
        "finish_reason": _scalar((piece.finish_reason or "").encode(), np.object_),
    }
    if returns.log_probs:
        out["output_ids"] = _row(piece.token_ids, np.int32)
        out["output_log_probs"] = _row([e.logprob for e in piece.logprobs], np.float32)
        out["cum_log_probs"] = _scalar(piece.cumulative_logprob or 0.0, np.float32)
        if returns.top_logprobs:
            out["output_top_logprobs"], out["output_top_ids"] = _top(piece.logprobs, returns.top_logprobs)
    if returns.prompt_log_probs and piece.prompt_logprobs is not None:
        entries = piece.prompt_logprobs
        out["prompt_ids"] = _row(piece.prompt_ids or [], np.int32)
        out["prompt_log_probs"] = _row([np.nan if e is None else e.logprob for e in entries], np.float32)
        if returns.top_logprobs:
            out["prompt_top_logprobs"], out["prompt_top_ids"] = _top(entries, returns.top_logprobs)
    if returns.stop_reason:
        out["stop_reason"] = _scalar((piece.stop_reason or "").encode(), np.object_)
    if returns.cumulative_logprob:
        out["cumulative_logprob"] = _scalar(piece.cumulative_logprob or 0.0, np.float32)
    if returns.perf_metrics:
        kv, t = piece.kv_reuse or KVReuse(), piece.timings
        out |= {
            "kv_cache_reused_block": _scalar(kv.reused_blocks, np.int32),
            "kv_cache_missed_block": _scalar(kv.missed_blocks, np.int32),
            "kv_cache_alloc_new_blocks": _scalar(kv.new_blocks, np.int32),
            "kv_cache_alloc_total_blocks": _scalar(kv.total_blocks, np.int32),
            "kv_cache_hit_rate": _scalar(kv.hit_rate, np.float32),
            "arrival_time_ns": _scalar(_ns(t.arrival if t else None), np.int64),
            "first_scheduled_time_ns": _scalar(_ns(t.scheduled if t else None), np.int64),
            "first_token_time_ns": _scalar(_ns(t.first_token if t else None), np.int64),
            "last_token_time_ns": _scalar(_ns(t.last_token if t else None), np.int64),
            "acceptance_rate": _scalar(0.0, np.float32),
            "total_accepted_draft_tokens": _scalar(0, np.int32),
            "total_draft_tokens": _scalar(0, np.int32),
        }
    return out


# --- the docs tables -------------------------------------------------------------------------------------------
_TYPES = {S: "BYTES", I32: "INT32", U64: "UINT64", F32: "FP32", B: "BOOL", "TYPE_INT64": "INT64"}


def markdown_tables() -> str:
    rows = ["| TensorRT-engine name | LLM-API name | Type | Shape | Meaning |", "|---|---|---|---|---|"]
    for s in INPUTS:
        meaning = f"Refused by name: {s.refused}." if s.refused else s.doc
        shape = "[1, n]" if s.dims == "-1" else "[1, 1]"
        rows.append(
            f"| {f'`{s.trtllm}`' if s.trtllm else '-'} | {f'`{s.llmapi}`' if s.llmapi else '-'} | "
            f"{_TYPES[s.dtype]} | {shape} | {meaning} |"
        )
    rows += ["", "| Output | Type | Shape | Meaning |", "|---|---|---|---|"]
    for o in OUTPUTS:
        shape = {"1": "[1, 1]", "-1": "[1, n]", "-1, -1": "[1, n, k]"}[o.dims]
        rows.append(f"| `{o.name}` | {_TYPES[o.dtype]} | {shape} | {o.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_tables())
