import pytest
from tests.engine_fixtures import fragment_dir

from trtllm_backend.manifest import Manifest
from trtllm_backend.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.needs_model


def tok() -> Tokenizer:
    return Tokenizer(Manifest(fragment_dir()))


def stream(t: Tokenizer, prompt: str, text: str) -> list[str]:
    d = IncrementalDetokenizer(t, t.encode(prompt))
    ids = t.encode(prompt + text)[len(t.encode(prompt)) :]
    return [d.add(i) for i in ids] + [d.flush()]


def test_round_trip_and_specials():
    t = tok()
    s = "Hello  world,\n\tdigits 12345 and ünïcödé"
    assert t.decode(t.encode(s)) == s
    assert t.encode("<|im_start|>") == [1]
    assert t.encode("123") == [t.encode("1")[0], t.encode("2")[0], t.encode("3")[0]]  # digits split one by one
    assert {0, 2} <= t.eos_token_ids


def test_incremental_keeps_whitespace_and_never_splits_a_character():
    t = tok()
    text = " café  😀 naïve\n\n  end 東京"
    pieces = stream(t, "Say:", text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # The emoji is several byte-level tokens: some steps must have emitted nothing while waiting for bytes.
    assert len(t.encode("😀")) > 1 and "" in pieces[:-1]


def test_chat_template_renders_chatml():
    p = tok().chat_prompt("hi")
    assert p.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- against the GGUF itself ------------------------------------------------------------------------------------
# tokenizer.json is rebuilt from the GGUF's metadata by engines.gguf_import; these check it against the file's own
# token list and against an independent converter of the same file (transformers' GGUF loader).
TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "Hello  world,\n\tdigits 12345 and 3.14159, ünïcödé",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # O(2**n)\n",
    "   leading spaces, trailing tabs\t\t\r\nCRLF line and 😀 emoji, 東京 and Ελληνικά",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    'URL https://example.com/a?b=c&d=e, e-mail a.b@c.org, {"json": [1, 2, null]}',
]


def gguf_tokens() -> list[str]:
    from gguf import GGUFReader

    from engines.gguf_import import embedded_model_path

    return GGUFReader(embedded_model_path()).fields["tokenizer.ggml.tokens"].contents()


def test_vocabulary_is_the_gguf_token_list():
    from tokenizers import Tokenizer as HFTokenizer

    m = Manifest(fragment_dir())
    ours = HFTokenizer.from_file(str(m.side_file(m.data["tokenizer"]["file"])))
    tokens = gguf_tokens()
    assert ours.get_vocab_size(with_added_tokens=True) == len(tokens) == m.config.vocab_size
    assert [ours.id_to_token(i) for i in range(len(tokens))] == tokens


def test_encoding_matches_transformers_gguf_loader():
    from transformers import AutoTokenizer

    from engines.gguf_import import embedded_model_path

    path = embedded_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    t = tok()
    for text in TEXTS:
        ids = t.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert t.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
