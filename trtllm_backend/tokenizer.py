"""Tokenizer of a fragment set, ChatML rendering, and incremental detokenization."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer

from .manifest import Manifest

_END_OF_TEXT = "<|endoftext|>"


class Tokenizer:
    def __init__(self, manifest: Manifest):
        meta = manifest.data["tokenizer"]
        self._tok = HFTokenizer.from_file(str(manifest.side_file(meta["file"])))
        eos = {manifest.config.eos_token_id}
        end = self._tok.token_to_id(_END_OF_TEXT)
        if end is not None:
            eos.add(end)
        self.eos_token_ids = frozenset(eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def to_json(self) -> str:
        """The tokenizer's own JSON (what grammar libraries build their token tables from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def chat_prompt(
        self, user: str, system: str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    ) -> str:
        """ChatML, the template of SmolLM2-Instruct (rendered without jinja)."""
        return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids: keeps whitespace, never emits half a UTF-8 character.

    Decodes a short window (prefix_offset..) twice, as vLLM does, so byte-level merges across token
    boundaries come out right; a trailing U+FFFD means an incomplete character, so we wait for more.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])  # a little context so the first token's leading space survives
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back when the request ends (an incomplete character stays as U+FFFD)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
