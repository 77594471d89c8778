"""trtllm_backend.openai.tokens: each token's own bytes and string from the fragments' byte-level vocabulary."""

import pytest
from tests import ROOT

from trtllm_backend.openai.tokens import TokenTexts

pytestmark = pytest.mark.needs_model  # the fragments' tokenizer
FRAGMENTS = ROOT / "model_repository" / "smollm2" / "1" / "fragments"


def test_token_bytes_join_to_the_text_and_partial_characters_are_replaced():
    texts = TokenTexts.from_fragments(FRAGMENTS)
    sentence = "The capital of France is Paris. Café 日本"
    ids = texts._tok.encode(sentence, add_special_tokens=False).ids
    assert b"".join(texts.bytes(i) for i in ids).decode() == sentence
    assert [texts.text(i) for i in ids[:2]] == ["The", " capital"]
    assert any("\ufffd" in texts.text(i) for i in ids)  # 日 spans several tokens: each alone is a partial character


def test_special_tokens_read_as_themselves():
    texts = TokenTexts.from_fragments(FRAGMENTS)
    end = texts._tok.token_to_id("<|im_end|>")
    assert texts.text(end) == "<|im_end|>"
