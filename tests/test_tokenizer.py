from engine_fixtures import fragment_dir

from trtllm_backend.manifest import Manifest
from trtllm_backend.tokenizer import IncrementalDetokenizer, Tokenizer


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
