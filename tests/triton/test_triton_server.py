"""Integration tests against a real tritonserver serving the real engine (no mocks).

gRPC streaming, HTTP generate / generate_stream, 16 concurrent clients checked against offline greedy
decoding (near-tie rule), cancellation freeing KV blocks, bad input over the wire, the queue cap, metrics,
a short perf_analyzer sweep, and a bad parameter refused at model load.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests import ROOT

from tests.triton_fixtures import TEST_SERVER_PARAMS

from trtllm_backend.serve import free_ports

pytestmark = [pytest.mark.needs_model, pytest.mark.server]
MODEL = "smollm2"
TRITON_TYPES = {
    "text_input": "BYTES",
    "max_tokens": "INT32",
    "stream": "BOOL",
    "temperature": "FP32",
    "top_k": "INT32",
    "top_p": "FP32",
    "random_seed": "UINT64",
    "stop_words": "BYTES",
    "exclude_input_in_output": "BOOL",
    "min_length": "INT32",
    "beam_width": "INT32",
    "stop": "BOOL",
}
NUMPY_TYPES = {
    "BYTES": np.object_,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
    "FP32": np.float32,
    "UINT64": np.uint64,
}
NEAR_TIE = 1e-3  # the engine issue's rule: greedy runs may part after a top-2 logit gap this small


# --- clients ----------------------------------------------------------------------------------------------------
def tensor(name: str, value, dtype: str | None = None, shape: tuple[int, ...] | None = None):
    """An input as TensorRT-LLM clients send it: shape [1, 1] (or [1, n] for lists) unless told otherwise."""
    dtype = dtype or TRITON_TYPES[name]
    values = value if isinstance(value, list) else [value]
    if dtype == "BYTES":
        values = [v.encode() if isinstance(v, str) else v for v in values]
    array = np.array([values], dtype=NUMPY_TYPES[dtype])
    if shape is not None:
        array = array.reshape(shape)
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def inputs(**values) -> list:
    return [tensor(name, value) for name, value in values.items()]


@dataclass
class StreamResult:
    texts: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    int4: list[list[int]] = field(default_factory=list)
    error: str | None = None
    ttft_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


class GrpcStream:
    """One client with one open stream; requests are awaited one at a time by id."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.answered = threading.Event()  # set at the first response (or error) the stream receives
        self.client.start_stream(callback=self._on_event)

    def _on_event(self, result, error) -> None:
        self.events.put((result, error, time.monotonic()))
        self.answered.set()

    def send(self, tensors: list, request_id: str = "") -> None:
        self.client.async_stream_infer(MODEL, tensors, request_id=request_id, enable_empty_final_response=True)

    def collect(self, timeout: float = 60.0, sent_at: float | None = None) -> StreamResult:
        out = StreamResult()
        while True:
            result, error, at = self.events.get(timeout=timeout)
            if error is not None:
                out.error = error.message()
                return out
            if result.as_numpy("text_output") is not None:
                if out.ttft_s is None and sent_at is not None:
                    out.ttft_s = at - sent_at
                out.texts.append(result.as_numpy("text_output").reshape(-1)[0].decode())
                out.counts.append(int(result.as_numpy("output_token_count").reshape(-1)[0]))
                out.int4.append(result.as_numpy("int4_layers").reshape(-1).tolist())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out

    def request(self, tensors: list, request_id: str = "", timeout: float = 60.0) -> StreamResult:
        sent_at = time.monotonic()
        self.send(tensors, request_id)
        return self.collect(timeout, sent_at)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_generate(url: str, prompt: str, max_tokens: int) -> StreamResult:
    s = GrpcStream(url)
    try:
        return s.request(inputs(text_input=prompt, max_tokens=max_tokens, stream=True))
    finally:
        s.close()


def http_post(server, path: str, body: dict | bytes) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]


def metrics(server) -> dict[str, float]:
    """`name{labels}` -> value, the model/version labels dropped for brevity."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("morphserve_"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'(model="[^"]*",?|version="[^"]*",?)', "", key).replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out


def settled_metrics(server, timeout: float = 10.0) -> dict[str, float]:
    """Metrics once two reads a few metric ticks apart agree."""
    previous = metrics(server)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        current = metrics(server)
        if current == previous:
            return current
        previous = current
    return previous


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def corpus_prompts(n: int) -> list[str]:
    """Prompts of different lengths cut from the corpus when it is there, else fixed sentences."""
    from tools.perf_analyzer import DEFAULT_CORPUS
    from tools.perf_analyzer import corpus_prompts as cut

    if DEFAULT_CORPUS.exists():
        return [" ".join(p.split()[: 8 + 3 * (i % 7)]) for i, p in enumerate(cut(DEFAULT_CORPUS, n, 30))]
    return [f"Story {i}: once upon a time, in a village by the sea, there lived" + " a" * (i % 5) for i in range(n)]


# --- the basics -------------------------------------------------------------------------------------------------
def test_grpc_streaming(triton_server):
    s = GrpcStream(triton_server.grpc_url)
    try:
        r = s.request(inputs(text_input="The capital of France is", max_tokens=6, stream=True))
    finally:
        s.close()
    assert r.error is None
    assert r.text.startswith(" Paris"), r.text
    assert len(r.texts) >= 2, "a streamed request gets several responses"
    assert sum(r.counts) == 6 and all(len(i4) == c for i4, c in zip(r.int4, r.counts))
    assert all(v == 0 for i4 in r.int4 for v in i4)  # no morphing in this test server


def test_http_generate_returns_one_response_with_the_prompt(triton_server):
    status, body = http_post(triton_server, "generate", {"text_input": "The capital of France is", "max_tokens": 6})
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"].startswith("The capital of France is Paris"), out
    assert out["output_token_count"] == 6 and len(out["int4_layers"]) == 6


def test_http_generate_stream_sse(triton_server):
    # Exactly what the vLLM serving benchmark's tensorrt-llm client posts (an unknown key included).
    body = {
        "accumulate_tokens": True,
        "text_input": "The capital of France is",
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 6,
        "stream": True,
        "min_length": 6,
    }
    status, text = http_post(triton_server, "generate_stream", body)
    assert status == 200, text
    events = sse_events(text)
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events).startswith(" Paris")
    assert sum(e["output_token_count"] for e in events) == 6


def test_sampling_inputs_are_honoured(triton_server):
    s = GrpcStream(triton_server.grpc_url)
    try:
        common = dict(text_input="Once upon a time", max_tokens=12, temperature=1.0, top_k=50, top_p=0.9)
        a = s.request(inputs(**common, random_seed=7))
        b = s.request(inputs(**common, random_seed=7))
        stopped = s.request(inputs(text_input="The capital of France is", max_tokens=12, stop_words=["."]))
        at_least = s.request(inputs(text_input="The capital of France is", max_tokens=12, min_length=12))
    finally:
        s.close()
    assert a.error is None and a.text == b.text  # seeded sampling is reproducible
    assert stopped.text == "The capital of France is Paris", stopped.text  # cut at the stop word
    assert sum(at_least.counts) == 12


# --- both TensorRT-LLM name sets, log probs ---------------------------------------------------------------------
def named(**values) -> list:
    """Inputs under any name of the model's table (trtllm_backend/triton/interface.py), with their declared type."""
    from trtllm_backend.triton.interface import _TYPES, BY_NAME

    return [tensor(name, value, _TYPES[BY_NAME[name].dtype]) for name, value in values.items()]


def grpc_results(url: str, tensors: list, timeout: float = 60.0) -> list:
    """Every response of one streamed request (an error raises)."""
    s = GrpcStream(url)
    try:
        s.send(tensors)
        results = []
        while True:
            result, error, _ = s.events.get(timeout=timeout)
            if error is not None:
                raise AssertionError(error.message())
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        s.close()


def test_llmapi_names_stream_the_whole_text_and_report_timing(triton_server):
    # Longer than two KV blocks, so the plain request leaves full blocks in the prefix cache for the second.
    prompt = (
        "Paris is the capital and largest city of France. It sits on the Seine river in the north of the "
        "country, and it has been a centre of finance, diplomacy, commerce, fashion and science for "
        "centuries. The capital of France is"
    )
    plain = stream_generate(triton_server.grpc_url, prompt, 8)
    results = grpc_results(
        triton_server.grpc_url,
        named(
            text_input=prompt,
            sampling_param_max_tokens=8,
            streaming=True,
            sampling_param_temperature=0.0,
            return_finish_reason=True,
            return_stop_reason=True,
            return_cumulative_logprob=True,
            sampling_param_return_perf_metrics=True,
        ),
    )
    texts = [
        r.as_numpy("text_output").reshape(-1)[0].decode() for r in results if r.as_numpy("text_output") is not None
    ]
    assert texts[-1] == plain.text and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    last = [r for r in results if r.as_numpy("text_output") is not None][-1]
    one = {
        n: last.as_numpy(n).reshape(-1)[0]
        for n in (
            "finish_reason",
            "stop_reason",
            "cumulative_logprob",
            "arrival_time_ns",
            "first_scheduled_time_ns",
            "first_token_time_ns",
            "last_token_time_ns",
            "kv_cache_reused_block",
            "kv_cache_missed_block",
            "kv_cache_alloc_total_blocks",
            "kv_cache_hit_rate",
            "total_draft_tokens",
        )
    }
    assert one["finish_reason"] == b"length" and one["stop_reason"] == b""
    assert one["cumulative_logprob"] < 0
    assert (
        0
        < one["arrival_time_ns"]
        <= one["first_scheduled_time_ns"]
        <= one["first_token_time_ns"]
        <= one["last_token_time_ns"]
    )
    # the plain request left its full prompt blocks cached; nothing runs in between to evict them
    assert one["kv_cache_reused_block"] >= 1 and 0 < one["kv_cache_hit_rate"] <= 1
    assert one["kv_cache_alloc_total_blocks"] >= one["kv_cache_reused_block"] and one["total_draft_tokens"] == 0


def test_llmapi_names_over_http_and_refusals_by_name(triton_server):
    status, body = http_post(
        triton_server,
        "generate",
        {
            "text_input": "The capital of France is",
            "sampling_param_max_tokens": 6,
            "return_stop_reason": True,
            "sampling_param_stop": ["."],
        },
    )
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"] == " Paris" and out["stop_reason"] == "." and out["finish_reason"] == "stop", out
    for bad, name in (
        ({"lora_name": "x"}, "lora_name"),
        ({"max_tokens": 3, "sampling_param_max_tokens": 4}, "sampling_param_max_tokens"),
    ):
        status, body = http_post(triton_server, "generate", {"text_input": "Hi"} | bad)
        assert status == 400 and f"{name}: " in body, body
    assert stream_generate(triton_server.grpc_url, "Hi", 2).error is None  # the server carries on
    status, body = http_post(
        triton_server,
        "generate",
        {"text_input": "The capital of France is", "max_tokens": 3, "top_logprobs": 2, "exclude_input_in_output": True},
    )
    assert status == 200, body
    out = json.loads(body)  # the [1, n, k] alternatives come back over HTTP too
    assert len(out["output_log_probs"]) == 3 and len(out["output_top_logprobs"]) in (3, 6), out


def test_log_probs_over_grpc_with_alternatives_and_the_prompt(triton_server):
    prompt = "The capital of France is"
    results = grpc_results(
        triton_server.grpc_url,
        named(text_input=prompt, max_tokens=5, stream=True, top_logprobs=3, return_prompt_log_probs=True),
    )
    pieces = [r for r in results if r.as_numpy("text_output") is not None]
    ids = np.concatenate([r.as_numpy("output_ids").reshape(-1) for r in pieces])
    lps = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in pieces])
    top_ids = np.concatenate([r.as_numpy("output_top_ids").reshape(-1, 3) for r in pieces])
    top = np.concatenate([r.as_numpy("output_top_logprobs").reshape(-1, 3) for r in pieces])
    assert len(ids) == len(lps) == len(top_ids) == 5
    assert (top_ids[:, 0] == ids).all() and np.allclose(top[:, 0], lps)  # greedy: the chosen token is the top one
    assert (np.diff(top, axis=1) <= 0).all() and (lps <= 0).all()
    assert np.isclose(pieces[-1].as_numpy("cum_log_probs").reshape(-1)[0], lps.sum(), atol=1e-4)
    prompt_lps = pieces[0].as_numpy("prompt_log_probs").reshape(-1)
    prompt_ids = pieces[0].as_numpy("prompt_ids").reshape(-1)
    assert len(prompt_lps) == len(prompt_ids) == int(pieces[0].as_numpy("prompt_token_count").reshape(-1)[0])
    assert np.isnan(prompt_lps[0]) and (prompt_lps[1:] <= 0).all()
    assert pieces[1].as_numpy("prompt_log_probs") is None  # the prompt's scores come once


def test_guided_decoding_over_grpc_matches_the_schema(triton_server):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    prompt = "<|im_start|>user\nDescribe Paris as JSON.<|im_end|>\n<|im_start|>assistant\n"
    r = stream_generate_guided(triton_server, prompt, "json_schema", json.dumps(schema))
    assert r.error is None, r.error
    jsonschema.validate(json.loads(r.text), schema)
    bad = stream_generate_guided(triton_server, prompt, "json_schema", "{not json")
    assert bad.error and bad.error.startswith("guided_decoding_guide: "), bad.error
    bad = stream_generate_guided(triton_server, prompt, "structural_tag", "{}")
    assert bad.error and bad.error.startswith("guided_decoding_guide_type: "), bad.error


def stream_generate_guided(triton_server, prompt: str, kind: str, guide: str) -> StreamResult:
    s = GrpcStream(triton_server.grpc_url)
    try:
        return s.request(
            inputs(text_input=prompt, max_tokens=64, stream=True)
            + named(guided_decoding_guide_type=kind, guided_decoding_guide=guide)
        )
    finally:
        s.close()


# --- 16 concurrent clients vs. offline greedy -----------------------------------------------------------------
@pytest.fixture(scope="module")
def offline_engine():
    from trtllm_backend.engine import LLMEngine
    from trtllm_backend.triton import params as triton_params
    from trtllm_backend.triton.config_pbtxt import model_parameters

    parsed = model_parameters(ROOT / "model_repository", MODEL, TEST_SERVER_PARAMS)
    return LLMEngine(triton_params.engine_config(parsed))


def token_pieces(responses: list[tuple[str, int]]) -> list[str]:
    """(text, tokens) responses -> one text per token; a response's text goes on its last token."""
    pieces: list[str] = []
    for text, count in responses:
        if count:
            pieces.extend([""] * (count - 1) + [text])
        elif pieces:
            pieces[-1] += text
    return pieces


def offline_greedy(engine, prompt: str, max_tokens: int) -> tuple[list[str], list[float]]:
    """Per-token text of a lone in-process run, and each step's top-2 logit gap."""
    from trtllm_backend.sampling import SamplingParams

    gaps: list[float] = []

    def record(_rid, row):
        top = row.float().topk(2).values
        gaps.append(float(top[0] - top[1]))

    engine.on_logits = record
    try:
        outs = list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens)))
    finally:
        engine.on_logits = None
    return token_pieces([(o.text, len(o.token_ids)) for o in outs]), gaps


def assert_greedy_match(served: list[str], offline: list[str], gaps: list[float], prompt: str) -> None:
    """Equal, or parted only after a near tie of the lone run (the text of token k depends on tokens <= k)."""
    n = min(len(served), len(offline))
    for k in range(n):
        if "".join(served[: k + 1]) != "".join(offline[: k + 1]):
            window = gaps[max(0, k - 3) : k + 1]  # a token may change without changing its text yet
            assert window and min(window) < NEAR_TIE, (
                f"served and offline greedy differ at token {k} without a near tie (gaps {window})\n"
                f"prompt: {prompt!r}\nserved:  {''.join(served)!r}\noffline: {''.join(offline)!r}"
            )
            return
    assert len(served) == len(offline), (served, offline)


def test_sixteen_concurrent_clients_match_offline_greedy(triton_server, offline_engine):
    prompts = corpus_prompts(16)
    max_tokens = 8  # NOTE: the lone offline runs dominate this test's time
    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(lambda p: stream_generate(triton_server.grpc_url, p, max_tokens), prompts))
    assert all(r.error is None for r in served), [r.error for r in served]
    for prompt, result in zip(prompts, served):
        offline, gaps = offline_greedy(offline_engine, prompt, max_tokens)
        assert_greedy_match(token_pieces(list(zip(result.texts, result.counts))), offline, gaps, prompt)


# --- cancellation -----------------------------------------------------------------------------------------------
def test_cancelled_stream_frees_its_kv_blocks(triton_server):
    before = metrics(triton_server)
    s = GrpcStream(triton_server.grpc_url)
    s.send(inputs(text_input="Tell me a long story.", max_tokens=1000, min_length=1000, stream=True))
    s.events.get(timeout=60)  # the first token: the request holds KV blocks now
    assert wait_for(lambda: metrics(triton_server)['morphserve_kv_cache_blocks{type="used"}'] > 0)
    s.close(cancel=True)
    assert wait_for(lambda: metrics(triton_server)['morphserve_kv_cache_blocks{type="used"}'] == 0, timeout=30)
    after = metrics(triton_server)
    cancelled = 'morphserve_requests_total{status="cancelled"}'
    assert after[cancelled] == before[cancelled] + 1
    assert after['morphserve_requests{state="active"}'] == 0


def test_stop_input_cancels_the_request_with_that_id(triton_server):
    s, stopper = GrpcStream(triton_server.grpc_url), GrpcStream(triton_server.grpc_url)
    try:
        s.send(
            inputs(text_input="Tell me a long story.", max_tokens=1000, min_length=1000, stream=True),
            request_id="long-1",
        )
        s.events.get(timeout=60)
        ack = stopper.request([tensor("stop", True)], request_id="long-1")
        assert ack.error is None
        # the stream ends (final response) because of the stop, not because it ran out: a generous bound on the
        # wait, and the proof is the count (1000 tokens take minutes here; a fixed few-second window flaked)
        rest = s.collect(timeout=120)
        assert rest.error is None
        assert sum(rest.counts) < 999
    finally:
        s.close()
        stopper.close()
    assert wait_for(lambda: metrics(triton_server)['morphserve_kv_cache_blocks{type="used"}'] == 0, timeout=30)


# --- bad input over the wire ------------------------------------------------------------------------------------
PROMPT = tensor("text_input", "Hello there")
BAD_GRPC = [
    ("missing text_input", [tensor("max_tokens", 4)], "text_input"),
    ("empty text", [tensor("text_input", "")], "text_input"),
    ("non-UTF-8 text", [tensor("text_input", b"\xff\xfe\xfd")], "text_input"),
    ("text_input shape [1]", [tensor("text_input", "Hi", shape=(1,))], "text_input"),
    ("text_input two prompts", [tensor("text_input", ["a", "b"])], "text_input"),
    ("max_tokens INT64", [PROMPT, tensor("max_tokens", 4, dtype="INT64")], "max_tokens"),
    ("max_tokens FP32", [PROMPT, tensor("max_tokens", 4, dtype="FP32")], "max_tokens"),
    ("max_tokens shape [1, 2]", [PROMPT, tensor("max_tokens", [4, 5])], "max_tokens"),
    ("max_tokens 0", [PROMPT, tensor("max_tokens", 0)], "max_tokens"),
    ("max_tokens beyond the context", [PROMPT, tensor("max_tokens", 100000)], "max_tokens"),
    ("temperature < 0", [PROMPT, tensor("temperature", -0.5)], "temperature"),
    ("temperature NaN", [PROMPT, tensor("temperature", float("nan"))], "temperature"),
    ("top_p 0", [PROMPT, tensor("top_p", 0.0)], "top_p"),
    ("top_p > 1", [PROMPT, tensor("top_p", 1.5)], "top_p"),
    ("top_k < 0", [PROMPT, tensor("top_k", -1)], "top_k"),
    ("min_length < 0", [PROMPT, tensor("min_length", -3)], "min_length"),
    ("stream as INT32", [PROMPT, tensor("stream", 1, dtype="INT32")], "stream"),
    ("beam search", [PROMPT, tensor("beam_width", 4)], "beam_width"),
    ("unknown input", [PROMPT, tensor("bad_words", "x", dtype="BYTES")], "bad_words"),
    ("prompt longer than the KV pool", [tensor("text_input", "word " * 3000)], "text_input"),
]


def test_bad_grpc_input_gets_an_error_naming_the_field(triton_server):
    s = GrpcStream(triton_server.grpc_url)
    try:
        for label, tensors, name in BAD_GRPC:
            r = s.request(tensors)
            assert r.error is not None, label
            assert name in r.error, f"{label}: {r.error}"
        ok = s.request(inputs(text_input="The capital of France is", max_tokens=3))
        assert ok.error is None and ok.text.startswith("The capital of France is Paris")  # still serving
    finally:
        s.close()


@pytest.mark.parametrize(
    "body,name",
    [
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": ""}, "text_input"),
        ({"text_input": "Hi", "max_tokens": -1}, "max_tokens"),
        ({"text_input": "Hi", "max_tokens": 100000}, "max_tokens"),
        ({"text_input": "Hi", "temperature": -1}, "temperature"),
        ({"text_input": "Hi", "top_p": 2}, "top_p"),
        ({"text_input": "Hi", "min_length": -1}, "min_length"),
    ],
)
def test_bad_http_input_gets_400_naming_the_field(triton_server, body, name):
    status, text = http_post(triton_server, "generate", body)
    assert status == 400 and json.loads(text)["error"].startswith(f"{name}: "), (status, text)


def test_queue_cap_rejects_at_once_and_running_requests_finish(triton_server):
    """A burst of 40 on one stream: the engine holds max_queue_size waiting (+ up to max_batch_size running);
    the rest get UNAVAILABLE ("queue full") at once; every accepted request completes normally."""
    n, max_tokens = 40, 6
    s = GrpcStream(triton_server.grpc_url)
    results: dict[str, StreamResult] = {}
    errors: list[str] = []
    try:
        for i in range(n):
            s.send(
                inputs(text_input=f"Burst request number {i} says", max_tokens=max_tokens, stream=True),
                request_id=f"burst-{i}",
            )
        finals = 0
        while finals + len(errors) < n:
            result, error, _ = s.events.get(timeout=120)
            if error is not None:
                errors.append(error.message())
                continue
            rid = result.get_response().id
            r = results.setdefault(rid, StreamResult())
            if result.as_numpy("text_output") is not None:
                r.counts.append(int(result.as_numpy("output_token_count").reshape(-1)[0]))
            finals += result.get_response().parameters["triton_final_response"].bool_param
    finally:
        s.close()
    assert errors and all(e.startswith("queue full") for e in errors), errors[:3]
    assert len(errors) <= n - int(TEST_SERVER_PARAMS["max_queue_size"])
    assert all(sum(r.counts) == max_tokens for r in results.values())
    assert len(results) == n - len(errors)
    assert stream_generate(triton_server.grpc_url, "The capital of France is", 3).error is None


# --- metrics ----------------------------------------------------------------------------------------------------
METRIC_FAMILIES = [
    "morphserve_requests",
    "morphserve_kv_cache_blocks",
    "morphserve_kv_cache_usage_ratio",
    "morphserve_int4_layers",
    "morphserve_kv_capacity_blocks",
    "morphserve_memory_bytes",
    "morphserve_preemptions_total",
    "morphserve_prompt_tokens_total",
    "morphserve_generation_tokens_total",
    "morphserve_requests_total",
    "morphserve_layer_swaps_total",
    "morphserve_kv_resizes_total",
    "morphserve_swap_failures_total",
    "morphserve_time_to_first_token_seconds",
    "morphserve_time_per_output_token_seconds",
    "morphserve_e2e_request_latency_seconds",
    "morphserve_request_queue_time_seconds",
    "morphserve_swap_prepare_seconds",
    "morphserve_swap_apply_seconds",
]


def test_metrics_families_move_and_ttft_counts_served_requests(triton_server):
    text = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
    for family in METRIC_FAMILIES:
        assert f"# TYPE {family} " in text, family
    before = settled_metrics(triton_server)  # earlier tests' last requests may still be being accounted
    for _ in range(3):
        assert stream_generate(triton_server.grpc_url, "Hello, my name is", 4).error is None
    # The histograms are observed just after the final response leaves; the counters on the next metrics tick.
    e2e = "morphserve_e2e_request_latency_seconds_count"
    tokens = "morphserve_generation_tokens_total"
    after = wait_for(
        lambda: (m := metrics(triton_server))[e2e] >= before[e2e] + 3 and m[tokens] >= before[tokens] + 12 and m
    )
    ttft = "morphserve_time_to_first_token_seconds_count"
    success = 'morphserve_requests_total{status="success"}'
    assert after[ttft] - before[ttft] == 3 == after[success] - before[success]
    assert after[e2e] - before[e2e] == 3
    assert after["morphserve_prompt_tokens_total"] > before["morphserve_prompt_tokens_total"]
    capacity = int(TEST_SERVER_PARAMS["max_tokens_in_paged_kv_cache"]) // 16
    assert after["morphserve_kv_capacity_blocks"] == capacity == after['morphserve_kv_cache_blocks{type="max"}']
    # Every request that produced a token so far was timed: served (success) plus cancelled-after-a-token ones.
    assert after[ttft] >= after[success]


# --- perf_analyzer ----------------------------------------------------------------------------------------------
def test_perf_analyzer_streaming_sweep(triton_server, tmp_path):
    from tools import perf_analyzer as pa

    prompts = corpus_prompts(8)
    input_json = pa.write_input_json(prompts, max_tokens=8, path=tmp_path / "inputs.json")
    levels = pa.run_sweep(
        triton_server.grpc_url,
        MODEL,
        "1:4",
        input_json,
        tmp_path,
        ROOT / "build" / "perf_analyzer",
        request_count=2,
        timeout_s=180,
    )
    assert [lv.concurrency for lv in levels] == [1, 2, 3, 4]
    for lv in levels:
        assert lv.requests >= max(2, lv.concurrency) and 0 < lv.output_tokens <= 8 * lv.requests
        assert 0 < lv.ttft_p50_ms <= lv.e2e_p50_ms and lv.tokens_per_s > 0
    assert "concurrency" in pa.format_table(levels)


# --- a bad parameter fails the load, naming it -------------------------------------------------------------------
def test_bad_parameter_fails_model_load_naming_it(tmp_path):
    from trtllm_backend import serve

    http, grpc, metrics_port = free_ports(3)
    with pytest.raises(RuntimeError) as info:
        serve.launch(
            ROOT / "model_repository",
            http_port=http,
            grpc_port=grpc,
            metrics_port=metrics_port,
            params={"block_size": "sixteen"},
            check_params=False,
            build_dir=tmp_path,
            log_path=tmp_path / "server.log",
            ready_timeout=120,
            exit_timeout_s=5,
        )
    assert "parameter 'block_size'" in (tmp_path / "server.log").read_text(), str(info.value)


# --- a stub crash stops the server instead of leaving it hanging ---------------------------------------------------
def test_stub_crash_stops_the_server_instead_of_hanging(tmp_path):
    from trtllm_backend import serve

    http, grpc, metrics_port = free_ports(3)
    srv = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics_port,
        params=TEST_SERVER_PARAMS,
        build_dir=tmp_path,
        log_path=tmp_path / "server.log",
        exit_timeout_s=3,
    )
    try:
        (stub,) = srv.stub_pids()
        s = GrpcStream(srv.grpc_url)
        s.send(inputs(text_input="Once upon a time", max_tokens=1000, min_length=1000, stream=True))
        s.events.get(timeout=60)
        os.kill(stub, signal.SIGKILL)
        # Triton 2.51 would keep answering "ready" and never end this request; the launcher's watcher stops it.
        assert s.collect(timeout=60).error is not None
        assert wait_for(lambda: not srv.alive(), timeout=30)
        srv.stop()  # as serve's main loop does; Triton may have aborted before the watcher's next poll
        assert srv.stub_died
    finally:
        srv.stop()
    assert not srv.stub_pids() and not list(Path("/dev/shm").glob(srv.shm_prefix + "*"))
