"""Log probabilities of tokens and their top alternatives, from a batch of logit rows.

NOTE: these are the model's own distribution: log_softmax of the raw logits over the whole vocabulary,
*before* the sampling transforms (penalties, temperature, top-k / top-p, the min-length end-of-sequence mask,
grammar masks). That is what evaluation harnesses score with, and what vLLM returns by default; a sampled
token may therefore have a low logprob where the sampler's transforms made it likely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens of that position, most likely first


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits -> fp32 log probabilities (a new tensor: the logits may be masked afterwards)."""
    return torch.log_softmax(logits.float(), dim=-1)


def pick(logp: torch.Tensor, chosen: list[int], top_k: list[int]) -> list[TokenLogprob]:
    """Row r's logprob of token `chosen[r]` and its `top_k[r]` most likely alternatives."""
    if not chosen:
        return []
    ids = torch.tensor(chosen, dtype=torch.long)
    picked = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    k = max(top_k)
    if k:
        values, indices = torch.topk(logp, k, dim=-1)  # one call for the batch; each row keeps its own k
        values, indices = values.tolist(), indices.tolist()
    out = []
    for r, (token, lp) in enumerate(zip(chosen, picked)):
        top = tuple(zip(indices[r][: top_k[r]], values[r][: top_k[r]])) if top_k[r] else ()
        out.append(TokenLogprob(token, lp, top))
    return out
