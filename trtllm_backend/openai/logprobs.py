"""OpenAI's logprobs objects from the model's token ids, logprobs and alternatives.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}`; completions (the
legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, where an
echoed prompt's first token has no logprob (null). The values are the model's raw distribution (before the
sampling transforms: trtllm_backend/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tokens import TokenTexts
from .triton_client import Alternatives, Piece


@dataclass(slots=True)
class Scored:
    """Tokens with their logprobs (None: not scored, the prompt's first) and alternatives, in text order."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[Alternatives | None] = field(default_factory=list)

    def add(self, piece: Piece, with_prompt: bool) -> None:
        if with_prompt and piece.prompt_ids is not None:
            self.ids += piece.prompt_ids
            self.logprobs += piece.prompt_logprobs
            self.top += [t if lp is not None else None for t, lp in zip(piece.prompt_top, piece.prompt_logprobs)]
        self.ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.top += piece.top


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.bytes(token_id))}


def chat_logprobs(texts: TokenTexts, scored: Scored) -> dict:
    content = [
        _entry(texts, t, lp) | {"top_logprobs": [_entry(texts, a, v) for a, v in top or ()]}
        for t, lp, top in zip(scored.ids, scored.logprobs, scored.top)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, scored: Scored, offset: int) -> tuple[dict, int]:
    """The legacy object, its text offsets counted from `offset`; returns it and the offset after it."""
    tokens, offsets = [], []
    for t in scored.ids:
        tokens.append(texts.text(t))
        offsets.append(offset)
        offset += len(tokens[-1])
    top = [None if alts is None else {texts.text(a): v for a, v in alts} for alts in scored.top]
    return {"tokens": tokens, "token_logprobs": scored.logprobs, "top_logprobs": top, "text_offset": offsets}, offset
