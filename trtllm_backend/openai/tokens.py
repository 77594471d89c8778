"""Token ids -> the token strings and bytes OpenAI's logprobs report, from the fragments' `tokenizer.json`.

A byte-level BPE token is a run of bytes that need not be whole UTF-8 characters, so each token's own bytes
are read from its vocabulary entry (GPT-2's byte-to-character map, inverted) and its string is those bytes
decoded with U+FFFD for a partial character, as OpenAI reports such tokens.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer


def _bytes_of_chars() -> dict[str, int]:
    """GPT-2's map from the printable characters of a byte-level vocabulary back to bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._byte_of = _bytes_of_chars()
        self._special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}

    @classmethod
    def from_fragments(cls, fragment_dir: str | Path) -> "TokenTexts":
        manifest = json.loads((Path(fragment_dir) / "manifest.json").read_text())
        return cls(Tokenizer.from_file(str(Path(fragment_dir) / manifest["tokenizer"]["file"])))

    @lru_cache(maxsize=65536)
    def bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self._special or any(c not in self._byte_of for c in piece):
            return piece.encode()  # a special token (<|im_end|>) or a vocabulary that is not byte-level
        return bytes(self._byte_of[c] for c in piece)

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")
