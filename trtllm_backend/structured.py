"""Structured outputs: constrained decoding with llguidance, masks applied in the sampler for the whole batch.

A request's `Guide` (a JSON object, a JSON schema, a regular expression or a Lark / GBNF grammar) is compiled
into a matcher when the request is added (a bad guide is refused then, naming it). Each iteration the
constrained rows' allowed-token bitmasks are filled (on the engine thread) and applied to the logits
of the whole batch before sampling (logprobs are taken before: trtllm_backend/logprobs.py); each sampled token then advances its
matcher. The grammar allows end-of-sequence only where the text is complete, and nothing else once it is.

NOTE: llguidance, not xgrammar or outlines-core: the cheapest per token on this CPU of the three, with no GPU
dependencies and no per-schema precompilation (results/structured_outputs/ has the measurement).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import torch

from plugins.token_bitmask import apply_token_bitmask_

from .errors import InvalidRequest

GUIDE_TYPES = ("json", "json_schema", "regex", "grammar")
# NOTE: no free whitespace in JSON: a small model otherwise fills objects with newlines and indents it may
# never leave; one space after separators keeps the text readable.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Guide:
    """What the output must match. `json`: any JSON object (OpenAI's json_object); `json_schema`: `text` is the
    schema; `regex`: the whole output matches `text`; `grammar`: `text` is a Lark or GBNF grammar."""

    type: str
    text: str = ""

    def __post_init__(self):
        if self.type not in GUIDE_TYPES:
            raise InvalidRequest("guide", f"type must be one of {', '.join(GUIDE_TYPES)}, got {self.type!r}")
        if self.type != "json" and not self.text:
            raise InvalidRequest("guide", f"a {self.type} guide needs its text")

    def grammar(self) -> str:
        """The llguidance grammar of this guide (ValueError on bad text)."""
        if self.type == "json":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.type == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        return llguidance.grammar_from("regex" if self.type == "regex" else "grammar", self.text)


class GrammarCompiler:
    """Turns guides into matchers over one tokenizer (built once: ~1 s for a 49k vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, guide.grammar(), log_level=0)
        except ValueError as exc:
            raise InvalidRequest("guide", f"{guide.type}: {exc}") from None
        if matcher.is_error():
            raise InvalidRequest("guide", f"{guide.type}: {matcher.get_error()}")
        return matcher


class MaskBatch:
    """The iteration's constrained rows, masked together."""

    # NOTE: masks are filled on the engine thread, row by row (a few tens of microseconds each), rather than by
    # llguidance's parallel executor: no second thread pool beside the model's OpenMP threads on two cores.

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Set the logits of tokens each row's matcher forbids to -inf (in place)."""
        if not rows:
            return
        bitmask = torch.empty((len(rows), (logits.shape[1] + 31) // 32), dtype=torch.int32)
        row_bytes = bitmask.shape[1] * 4
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
        apply_token_bitmask_(logits, bitmask, rows)


def advance(matcher: llguidance.LLMatcher, token: int) -> None:
    """Feed the sampled token to its matcher (never refused: the mask allowed it)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused a token it allowed: {matcher.get_error()}")
