"""The OpenAI gateway against a real tritonserver serving the real engine (no mocks): the official `openai`
client (sync and streaming, chat and completions), curl for SSE, 16 concurrent streaming chats against the
engine's greedy output, exact usage, stop/length, penalties and seed reaching the model, cancellation on
client disconnect, bad input over the wire, the queue cap as a 503, the API key, the gateway's metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from tests import ROOT
from tests.triton.test_triton_server import (
    NEAR_TIE,
    corpus_prompts,
    inputs,
    metrics,
    offline_engine,  # noqa: F401
    offline_greedy,  # noqa: F401
    stream_generate,
    wait_for,
)

from trtllm_backend.openai.process import start_gateway
from trtllm_backend.openai.template import ChatTemplate
from trtllm_backend.triton.server import free_ports

pytestmark = [pytest.mark.needs_model, pytest.mark.server]
MODEL = "smollm2"
KEY = "test-key"
FRAGMENTS = ROOT / "model_repository" / "smollm2" / "1" / "fragments"
KV_USED = 'morphserve_kv_cache_blocks{type="used"}'


@pytest.fixture(scope="module")
def gateway(triton_server, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai") / "gateway.log"
    handle = start_gateway(triton_server.grpc_url, free_ports(1)[0], log_path=log, api_key=KEY)
    try:
        yield handle
    finally:
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it: -SIGTERM is a clean exit.
        assert handle.stop() in (0, -signal.SIGTERM) and "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rendered(text: str) -> str:
    return ChatTemplate.from_fragments(FRAGMENTS).render(chat(text))


def gateway_metric(gateway, prefix: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


# --- the basics with the official client -------------------------------------------------------------------------
def test_completion_sync_and_stream_match_triton(client, triton_server):
    direct = stream_generate(triton_server.grpc_url, "The capital of France is", 6)
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6)
    assert done.choices[0].text == direct.text and done.choices[0].text.startswith(" Paris")
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (5, 6, 11)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_sync_and_stream_with_exact_usage(client, offline_engine):
    prompt_ids = offline_engine.tokenizer.encode(rendered("What is the capital of France?"))
    done = client.chat.completions.create(
        model=MODEL, messages=chat("What is the capital of France?"), max_completion_tokens=12
    )
    message = done.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert done.usage.prompt_tokens == len(prompt_ids)
    # The engine's count: a natural stop's end-of-sequence token is generated, so it counts (as in vLLM).
    if done.choices[0].finish_reason == "stop":
        assert done.usage.completion_tokens == len(offline_engine.tokenizer.encode(message.content)) + 1
    else:
        assert done.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=chat("What is the capital of France?"),
            max_completion_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    streamed, once = chunks[-1].usage, done.usage
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        once.prompt_tokens,
        once.completion_tokens,
        once.total_tokens,
    )
    # the second asking of the same prompt finds at least what the first left in the prefix cache
    assert streamed.prompt_tokens_details.cached_tokens >= once.prompt_tokens_details.cached_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client):
    messages = chat(
        "Tell me, in a few words, why the sky over the sea looks blue on a clear summer afternoon, "
        "and why sunsets over the same sea look red and orange instead. " * 2
    )
    first = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens > 64
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens  # whole blocks reused; the last token is always prefilled
    assert first.usage.prompt_tokens_details.cached_tokens <= cached


def test_a_natural_end_is_stop_and_a_stop_string_is_cut(client):
    done = client.chat.completions.create(model=MODEL, messages=chat("Say just the word: yes"), max_tokens=64)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens < 64
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, stop=[" city", "."])
    assert (
        cut.choices[0].finish_reason == "stop" and "." not in cut.choices[0].text and " city" not in cut.choices[0].text
    )


def test_ignore_eos_runs_past_the_natural_end(client):
    """The same prompt that stops early above generates to max_tokens with vLLM's ignore_eos (benchmarks)."""
    forced = client.chat.completions.create(
        model=MODEL, messages=chat("Say just the word: yes"), max_tokens=24, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 24


def test_penalties_and_seed_reach_the_model(client, triton_server):
    prompt = "List: apple, apple, apple, apple, apple,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    penalized = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, frequency_penalty=2.0, presence_penalty=1.0
    )
    assert plain.choices[0].text != penalized.choices[0].text
    assert penalized.choices[0].text.count("apple") < plain.choices[0].text.count("apple")
    sampled = [
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=seed)
        .choices[0]
        .text
        for seed in (11, 11, 12)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    # The Triton model takes Triton's OpenAI-frontend inputs directly too (seed, the penalties).
    a = stream_generate_with(triton_server, prompt, seed=11)
    assert a.error is None and a.text


def stream_generate_with(triton_server, prompt: str, **extra):
    from tests.triton.test_triton_server import GrpcStream, tensor

    s = GrpcStream(triton_server.grpc_url)
    try:
        extra_tensors = [tensor("seed", v, "UINT64") if k == "seed" else tensor(k, v, "FP32") for k, v in extra.items()]
        return s.request(inputs(text_input=prompt, max_tokens=4, stream=True) + extra_tensors)
    finally:
        s.close()


# --- logprobs, echo, the fields SDKs send by default --------------------------------------------------------------
def test_chat_logprobs_sync_and_stream(client):
    args = dict(
        model=MODEL, messages=chat("What is the capital of France?"), max_tokens=8, logprobs=True, top_logprobs=3
    )
    done = client.chat.completions.create(**args)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely one, alternatives sorted
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
    if done.choices[0].finish_reason == "length":
        assert b"".join(bytes(e.bytes) for e in content).decode() == done.choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_echo_with_prompt_logprobs(client):
    prompt = "The capital of France is"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, echo=True)
    choice, usage = done.choices[0], done.usage
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == choice.text and lp.text_offset[usage.prompt_tokens] == len(prompt)
    streamed = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_fields_sdks_send_by_default_are_accepted(client):
    done = client.chat.completions.create(
        model=MODEL,
        messages=chat("hi"),
        max_tokens=2,
        store=False,
        response_format={"type": "text"},
        tools=[],
        metadata={"run": "test"},
    )
    assert done.usage.completion_tokens == 2


def test_json_schema_and_json_object_outputs_parse_and_validate(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    done = client.chat.completions.create(
        model=MODEL, messages=chat("Invent a person."), max_tokens=96, response_format=fmt
    )
    assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
    jsonschema.validate(json.loads(done.choices[0].message.content), schema)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=chat("Invent a person."),
            max_tokens=96,
            response_format=fmt,
            stream=True,
            temperature=0.8,
            seed=3,
        )
    )
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)
    anything = client.chat.completions.create(
        model=MODEL, messages=chat("Give me JSON about cats."), max_tokens=64, response_format={"type": "json_object"}
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=chat("hi"),
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            },
        )
    assert e.value.body["param"] == "response_format", e.value.body


def test_the_responses_api_gets_a_clear_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi")
    assert "/v1/chat/completions" in e.value.body["message"], e.value.body


def test_curl_sees_standard_sse(gateway):
    body = json.dumps({"model": MODEL, "messages": chat("Hi"), "max_tokens": 4, "stream": True})
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"{gateway.url}/v1/chat/completions",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and chunks[-1]["choices"][0]["finish_reason"]


# --- 16 concurrent streaming chats vs. the engine's greedy output ------------------------------------------------
def assert_text_matches_greedy(served: str, offline: list[str], gaps: list[float], prompt: str) -> None:
    """Equal, or parted only after a near tie of the lone run (the near-tie rule of the Triton tests)."""
    for k in range(len(offline)):
        if not served.startswith("".join(offline[: k + 1])):
            window = gaps[max(0, k - 3) : k + 1]
            assert window and min(window) < NEAR_TIE, (
                f"gateway and offline greedy differ at token {k} without a near tie (gaps {window})\n"
                f"prompt: {prompt!r}\nserved:  {served!r}\noffline: {''.join(offline)!r}"
            )
            return
    assert served == "".join(offline)


def test_sixteen_concurrent_streaming_chats_match_greedy(client, offline_engine):
    questions = corpus_prompts(16)
    max_tokens = 8

    def run(q: str) -> str:
        stream = client.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=max_tokens, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(run, questions))
    for q, text in zip(questions, served):
        offline, gaps = offline_greedy(offline_engine, rendered(q), max_tokens)
        assert_text_matches_greedy(text, offline, gaps, q)


# --- cancellation -------------------------------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_cancels_its_request(gateway, triton_server):
    cancelled = 'morphserve_requests_total{status="cancelled"}'
    before, gone_before = (
        metrics(triton_server)[cancelled],
        gateway_metric(gateway, "openai_gateway_client_disconnects_total"),
    )
    body = {"model": MODEL, "messages": chat("Tell me a very long story."), "max_tokens": 1000, "stream": True}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert wait_for(lambda: metrics(triton_server)[KV_USED] > 0)
    # The connection is closed: the request is aborted and its blocks return.
    assert wait_for(lambda: metrics(triton_server)[KV_USED] == 0, timeout=5)
    assert wait_for(lambda: metrics(triton_server)[cancelled] == before + 1, timeout=5)
    assert gateway_metric(gateway, "openai_gateway_client_disconnects_total") == gone_before + 1


def test_a_non_streaming_client_that_gives_up_cancels_its_request(gateway, triton_server):
    cancelled = 'morphserve_requests_total{status="cancelled"}'
    before = metrics(triton_server)[cancelled]
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1000}  # counting goes on and on
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=2)
    assert wait_for(lambda: metrics(triton_server)[cancelled] == before + 1, timeout=5)
    assert wait_for(lambda: metrics(triton_server)[KV_USED] == 0, timeout=5)


# --- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 2}, "n"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"store": True}, "store"),
        ({"frequency_penalty": 5.0}, "frequency_penalty"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
        ({"messages": chat("word " * 3000)}, "messages"),  # longer than the test server's KV cache
        ({"max_tokens": 100000}, "max_tokens"),  # more than the model context
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_the_server_carries_on(client, kwargs, param):
    args = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2).usage.completion_tokens == 2


def test_unknown_model_and_missing_key(client, gateway):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"))
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_full_queue_is_a_503_and_running_requests_continue(gateway, triton_server):
    # The test server runs 16 and queues 20: 40 long requests at once overflow it.
    results: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 64}
        r = httpx.post(
            f"{gateway.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300
        )
        with lock:
            results.append(r.status_code)
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "queue_full"

    with ThreadPoolExecutor(40) as pool:
        list(pool.map(one, range(40)))
    assert 503 in results and results.count(200) >= 16 and set(results) <= {200, 503}, results
    assert wait_for(lambda: metrics(triton_server)[KV_USED] == 0, timeout=10)


def test_gateway_metrics(gateway, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'openai_gateway_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'openai_gateway_time_to_first_token_seconds_count{endpoint="/v1/completions"}' in text
    assert gateway_metric(gateway, "openai_gateway_requests_in_flight") == 0
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}


# --- the launcher ---------------------------------------------------------------------------------------------------
def test_the_launcher_starts_and_stops_the_gateway_with_the_server(tmp_path):
    http, grpc, metrics_port, port = free_ports(4)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trtllm_backend.serve",
                "--http-port",
                str(http),
                "--grpc-port",
                str(grpc),
                "--metrics-port",
                str(metrics_port),
                "--openai-port",
                str(port),
                "--param",
                "morph_policy=full",
                "--param",
                "max_tokens_in_paged_kv_cache=1024",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
    try:
        assert wait_for(lambda: "OpenAI   http://localhost" in log.read_text() or proc.poll() is not None, timeout=300)
        assert proc.poll() is None, log.read_text()[-3000:]
        reply = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=3
        )
        assert reply.choices[0].text.startswith(" Paris")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
