"""trtllm_backend.openai.logprobs: OpenAI's chat and legacy completions logprobs objects from the model's ids."""

import pytest
from tests import ROOT

from trtllm_backend.openai.logprobs import Scored, chat_logprobs, completion_logprobs
from trtllm_backend.openai.tokens import TokenTexts
from trtllm_backend.openai.triton_client import Piece

pytestmark = pytest.mark.needs_model  # the fragments' tokenizer
FRAGMENTS = ROOT / "model_repository" / "smollm2" / "1" / "fragments"


def piece() -> tuple[TokenTexts, Piece]:
    texts = TokenTexts.from_fragments(FRAGMENTS)
    enc = lambda s: texts._tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    (paris,), (dot,) = enc(" Paris"), enc(".")
    prompt = enc("The capital")
    return texts, Piece(
        " Paris.",
        2,
        token_ids=[paris, dot],
        logprobs=[-0.1, -0.5],
        top=[[(paris, -0.1), (dot, -3.0)], [(dot, -0.5)]],
        prompt_ids=prompt,
        prompt_logprobs=[None, -4.0],
        prompt_top=[[], [(prompt[1], -4.0)]],
    )


def test_chat_logprobs_shape():
    texts, p = piece()
    scored = Scored()
    scored.add(p, with_prompt=False)
    obj = chat_logprobs(texts, scored)
    assert obj["refusal"] is None and [e["token"] for e in obj["content"]] == [" Paris", "."]
    first = obj["content"][0]
    assert first["logprob"] == -0.1 and first["bytes"] == list(b" Paris")
    assert [a["token"] for a in first["top_logprobs"]] == [" Paris", "."]


def test_completion_logprobs_with_echo_and_offsets():
    texts, p = piece()
    scored = Scored()
    scored.add(p, with_prompt=True)
    obj, end = completion_logprobs(texts, scored, 0)
    assert obj["tokens"] == ["The", " capital", " Paris", "."]
    assert obj["token_logprobs"] == [None, -4.0, -0.1, -0.5]
    assert obj["top_logprobs"][0] is None and obj["top_logprobs"][2] == {" Paris": -0.1, ".": -3.0}
    assert obj["text_offset"] == [0, 3, 11, 17] and end == 18
