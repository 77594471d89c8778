"""Prompts of an exact token length, cut from real text with the served model's tokenizer.

The corpus is tokenized once; prompt i starts at a different offset (a fixed stride through the text), so
requests do not share prefixes, and is trimmed until it re-encodes to the requested length (BPE merges at the
cut can change the count by a token or two).
"""

from __future__ import annotations

from pathlib import Path

from tools.replay.paths import repo_path
from trtllm_backend.manifest import Manifest
from trtllm_backend.tokenizer import Tokenizer

DEFAULT_CORPUS = "../shared/data/corpus/austen_novels.txt"  # relative to the repository root
DEFAULT_FRAGMENTS = "model_repository/smollm2/1/fragments"


def load_tokenizer(fragment_dir: str | Path = DEFAULT_FRAGMENTS):
    """The tokenizer the server uses: the fragment set's tokenizer.json (trtllm_backend.tokenizer)."""
    return Tokenizer(Manifest(repo_path(fragment_dir)))


class PromptSource:
    def __init__(self, tokenizer, corpus: str | Path = DEFAULT_CORPUS, max_chars: int = 400_000, stride: int = 7919):
        text = repo_path(corpus).read_text(encoding="utf-8", errors="replace")[:max_chars]
        # Collapse the novels' hard line wraps: prompts read as prose, and whitespace tokens do not dominate.
        self.tok = tokenizer
        self.ids = tokenizer.encode(" ".join(text.split()))
        self.stride = stride  # a prime, so offsets cycle through the whole text

    def prompt(self, index: int, n_tokens: int) -> tuple[str, int]:
        """(text, its token count); the count equals n_tokens unless the tokenizer makes that impossible."""
        if n_tokens >= len(self.ids):
            raise ValueError(f"a {n_tokens}-token prompt is longer than the corpus ({len(self.ids)} tokens)")
        start = (index * self.stride) % (len(self.ids) - n_tokens)
        end = start + n_tokens
        best = None
        for _ in range(8):
            text = self.tok.decode(self.ids[start:end]).strip()
            got = len(self.tok.encode(text))
            if best is None or abs(got - n_tokens) < abs(best[1] - n_tokens):
                best = (text, got)
            if got == n_tokens:
                break
            end += n_tokens - got
        return best
