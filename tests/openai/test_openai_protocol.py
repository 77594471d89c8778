"""Request parsing: strict types, unknown fields refused, unsupported OpenAI fields refused, each naming the field."""

import pytest

from trtllm_backend.openai.errors import OpenAIError
from trtllm_backend.openai.protocol import ChatCompletionRequest, CompletionRequest, parse

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "smollm2", "prompt": "Once upon a time"}


def test_good_requests_parse():
    chat = parse(
        ChatCompletionRequest,
        CHAT
        | {
            "max_completion_tokens": 5,
            "stop": "\n",
            "temperature": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "frequency_penalty": 0.5,
            "presence_penalty": -1.0,
            "seed": 7,
            "n": 1,
        },
    )
    assert chat.output_limit == ("max_completion_tokens", 5) and chat.stop_list == ["\n"] and chat.include_usage
    assert chat.temperature == 1.0
    parts = parse(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        },
    )
    assert parts.messages[0].text == "ab"
    dev = parse(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "x", "name": "ann"},
            ],
        },
    )
    assert [m.for_template() for m in dev.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "x", "name": "ann"},
    ]
    done = parse(CompletionRequest, COMPLETION | {"prompt": ["one"], "max_tokens": 3})
    assert done.text == "one" and done.output_limit == ("max_tokens", 3) and done.min_output is None


def test_vllm_extensions_set_the_minimum_output():
    forced = parse(ChatCompletionRequest, CHAT | {"max_completion_tokens": 7, "ignore_eos": True})
    assert forced.min_output == 7
    assert parse(CompletionRequest, COMPLETION | {"max_tokens": 9, "min_tokens": 4}).min_output == 4


@pytest.mark.parametrize(
    "body, param",
    [
        (CHAT | {"max_tokens": "5"}, "max_tokens"),
        (CHAT | {"max_tokens": 0}, "max_tokens"),
        (CHAT | {"max_tokens": 2.5}, "max_tokens"),
        (CHAT | {"max_completion_tokens": -1}, "max_completion_tokens"),
        (CHAT | {"max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens"),
        (CHAT | {"temperature": 2.5}, "temperature"),
        (CHAT | {"temperature": "hot"}, "temperature"),
        (CHAT | {"top_p": 0}, "top_p"),
        (CHAT | {"top_p": 1.01}, "top_p"),
        (CHAT | {"frequency_penalty": 3}, "frequency_penalty"),
        (CHAT | {"presence_penalty": -2.5}, "presence_penalty"),
        (CHAT | {"seed": -1}, "seed"),
        (CHAT | {"seed": 1.5}, "seed"),
        (CHAT | {"stream": 1}, "stream"),
        (CHAT | {"stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT | {"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
        (CHAT | {"stop": ["a", ""]}, "stop"),
        (CHAT | {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT | {"stop": 5}, "stop"),
        (CHAT | {"n": 2}, "n"),
        (CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT | {"store": True}, "store"),
        (CHAT | {"response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT | {"tool_choice": "auto"}, "tool_choice"),
        (CHAT | {"top_logprobs": 2}, "top_logprobs"),
        (CHAT | {"logit_bias": {"50": 1.0}}, "logit_bias"),
        (CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT | {"bogus": 1}, "bogus"),
        ({"messages": CHAT["messages"]}, "model"),
        (CHAT | {"model": 5}, "model"),
        (CHAT | {"messages": []}, "messages"),
        (CHAT | {"messages": "hi"}, "messages"),
        (CHAT | {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (CHAT | {"messages": [{"role": "user"}]}, "messages[0].content"),
        (CHAT | {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT | {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
        (
            CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
        (COMPLETION | {"prompt": ""}, "prompt"),
        (COMPLETION | {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETION | {"prompt": [1, 2, 3]}, "prompt[0]"),
        (COMPLETION | {"echo": 1}, "echo"),
        (COMPLETION | {"logprobs": 21}, "logprobs"),
        (COMPLETION | {"suffix": "x"}, "suffix"),
        (COMPLETION | {"best_of": 2}, "best_of"),
        (COMPLETION | {"ignore_eos": True}, "ignore_eos"),
        (COMPLETION | {"ignore_eos": 1, "max_tokens": 3}, "ignore_eos"),
        (COMPLETION | {"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        (COMPLETION | {"min_tokens": -1}, "min_tokens"),
        ({"model": "smollm2"}, "prompt"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(body, param):
    model = (
        CompletionRequest
        if "messages" not in body and "prompt" in body or body == {"model": "smollm2"}
        else ChatCompletionRequest
    )
    with pytest.raises(OpenAIError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.param == param, e.value.body()
    assert e.value.message.startswith(f"{param}: "), e.value.message


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(OpenAIError, match="JSON object") as e:
        parse(ChatCompletionRequest, [1, 2])
    assert e.value.status == 400


def test_fields_sdks_send_by_default_are_accepted():
    chat = parse(
        ChatCompletionRequest,
        CHAT
        | {
            "response_format": {"type": "text"},
            "store": False,
            "tools": [],
            "tool_choice": "none",
            "metadata": {"a": "b"},
        },
    )
    assert chat.alternatives is None
    assert parse(ChatCompletionRequest, CHAT | {"logprobs": True, "top_logprobs": 3}).alternatives == 3
    assert parse(ChatCompletionRequest, CHAT | {"logprobs": True}).alternatives == 0
    done = parse(CompletionRequest, COMPLETION | {"logprobs": 2, "echo": True})
    assert done.alternatives == 2 and done.echo


def test_unsupported_fields_are_refused_as_unsupported_not_unknown():
    with pytest.raises(OpenAIError) as e:
        parse(ChatCompletionRequest, CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]})
    assert e.value.param == "tools" and "not supported" in e.value.message and "unknown" not in e.value.message
