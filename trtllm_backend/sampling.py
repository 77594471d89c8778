"""Per-request sampling parameters and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from plugins.argmax import argmax_rows

from .errors import InvalidRequest
from .logprobs import MAX_TOP_LOGPROBS
from .priority import PRIORITY_MAX, PRIORITY_MIN, is_priority
from .structured import Guide


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # end-of-sequence and stop strings are ignored before this many tokens
    ignore_eos: bool = False
    # OpenAI's penalties, on the tokens generated so far (not the prompt): each logit is lowered by
    # frequency_penalty * count + presence_penalty * (count > 0). Negative values encourage repetition.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Scheduling, not sampling: carried here as the per-request set every surface already builds (scheduler.py).
    priority: int = 0
    # Log probabilities (trtllm_backend/logprobs.py says of which distribution): None = not computed; k >= 0 =
    # each generated (or, for prompt_logprobs, prompt) token's logprob and its k most likely alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guide: Guide | None = None  # structured output: what the text must match (trtllm_backend/structured.py)

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise InvalidRequest(key, f"unknown sampling field (known: {', '.join(sorted(known))})")
        return cls(**values)

    def validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or self.temperature != self.temperature
            or self.temperature < 0
        ):
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest("seed", f"must be an integer, got {self.seed!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (-2.0 <= value <= 2.0):
                raise InvalidRequest(name, f"must be a number in [-2, 2], got {value!r}")
        if not is_priority(self.priority):
            raise InvalidRequest(
                "priority",
                f"must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is more "
                f"important), got {self.priority!r}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS
            ):
                raise InvalidRequest(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {value!r}")
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise InvalidRequest("guide", f"must be a Guide, got {type(self.guide).__name__}")
            if self.ignore_eos or self.min_tokens:
                # NOTE: the grammar decides where the text may end; a forced length would contradict it
                raise InvalidRequest(
                    "min_tokens" if self.min_tokens else "ignore_eos",
                    "cannot be combined with a structured output (the grammar decides the end)",
                )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop", "must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]] | None
) -> torch.Tensor:
    """`logits` with each penalized row lowered for the tokens its request generated (a copy; the same
    tensor when no row is penalized)."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    if outputs is None or len(outputs) != len(params):
        raise ValueError("frequency/presence penalties need each row's generated token ids")
    logits = logits.clone()
    for r in rows:
        if not outputs[r]:
            continue
        ids, counts = torch.unique(torch.tensor(outputs[r], dtype=torch.long), return_counts=True)
        p = params[r]
        logits[r, ids] -= counts.to(logits.dtype) * p.frequency_penalty + p.presence_penalty
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: list[list[int]] | None = None,
) -> list[int]:
    """Pick one token per row of `logits` [batch, vocab] (fp32). `outputs`: each row's generated token ids so
    far, needed only when a row has a frequency or presence penalty."""
    logits = apply_penalties(logits, params, outputs)
    out: list[int] = []
    greedy_ids = argmax_rows(logits).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy_ids[row])
            continue
        # NOTE: shifted first, so a tiny temperature gives 0 and -inf, never inf - inf = nan (found by fuzzing)
        scores = (logits[row].float() - logits[row].max().float()) / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, idx = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # NOTE: keep the smallest prefix whose mass reaches top_p (the first token is always kept).
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
