"""The Triton inputs the gateway sends: TensorRT-LLM names, shape [1, 1], unset fields left to the model."""

from trtllm_backend.openai.triton_client import Generation, build_inputs


def _sent(gen: Generation) -> dict:
    return {t.name(): (t.datatype(), t.shape()) for t in build_inputs(gen)}


def test_only_the_fields_given_are_sent():
    assert _sent(Generation("hi")) == {"text_input": ("BYTES", [1, 1]), "stream": ("BOOL", [1, 1])}


def test_min_tokens_goes_to_min_length():
    sent = _sent(Generation("hi", max_tokens=8, min_tokens=8, seed=3, stop=("a", "b")))
    assert sent["min_length"] == ("INT32", [1, 1]) and sent["max_tokens"] == ("INT32", [1, 1])
    assert sent["random_seed"] == ("UINT64", [1, 1]) and sent["stop_words"] == ("BYTES", [1, 2])


def test_priority_goes_to_the_priority_input():
    assert _sent(Generation("hi", priority=3))["priority"] == ("INT32", [1, 1])
