"""Property-based fuzzing of the served model (hypothesis) over gRPC and HTTP, against the session's real
tritonserver: wrong types and shapes, extreme and negative numbers, empty and huge strings, invalid UTF-8 and
unusual Unicode, unknown and duplicated inputs, `stop` for unknown ids, and mixes of valid and invalid.

Properties: every request gets exactly one final response or one error naming an input it sent; the server
stays ready; once idle again every KV block is free and the memory account is back to its idle value.
A few hundred cases by default; MORPHSERVE_SOAK=1 (make soak) runs 2,400. MORPHSERVE_FUZZ_SEED replays a run
(the seed is printed); hypothesis shrinks a failure to a minimal example.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from tests.triton_fixtures import http_ready
from tests.triton.test_triton_server import MODEL, NUMPY_TYPES, settled_metrics

from trtllm_backend.triton.interface import _TYPES, INPUTS

SOAK = os.environ.get("MORPHSERVE_SOAK") == "1"
# A few hundred cases are part of `make test`; the 2,400 of MORPHSERVE_SOAK=1 are the soak tier (make soak).
pytestmark = [pytest.mark.needs_model, pytest.mark.server] + ([pytest.mark.soak] if SOAK else [])
CASES = 1200 if SOAK else 150  # per transport
SEED = int(os.environ.get("MORPHSERVE_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
print(f"[fuzz] seed {SEED} ({CASES} cases per transport); replay with MORPHSERVE_FUZZ_SEED={SEED}")
FUZZ = settings(
    max_examples=CASES, deadline=None, database=None, print_blob=True, suppress_health_check=list(HealthCheck)
)
# The model's inputs as config.pbtxt declares them: both TensorRT-LLM name sets, from the model's one table.
KNOWN = {name: _TYPES[spec.dtype] for spec in INPUTS for name in spec.names}
WIRE_TYPES = ["BYTES", "INT32", "INT64", "UINT64", "FP32", "BOOL"]
MAX_FAST_TOKENS = 4  # a request that passes validation generates at most this much: cases stay fast

# --- values ------------------------------------------------------------------------------------------------------
odd_text = st.one_of(
    st.text(max_size=40),  # any Unicode, surrogates excluded (they cannot be encoded)
    st.sampled_from(["", " ", "\x00", "\u202e\u200b", "🦙" * 50, "a" * 20000, "\ufeffHello", "Ω≈ç√∫"]),
)
odd_bytes = st.one_of(
    odd_text.map(lambda s: s.encode()),
    st.binary(max_size=32),
    st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"Hi \x80 there"]),
)
odd_number = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, -0.0, 1e-45, 3.4e38, -2.0, 2.0000001]),
)
# Inputs that pass validation with small values, so valid requests finish at once.
fast_valid = {
    "max_tokens": st.integers(1, MAX_FAST_TOKENS),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 50),
    "top_p": st.floats(0.01, 1),
    "random_seed": st.integers(0, 2**64 - 1),
    "seed": st.integers(0, 2**64 - 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "min_length": st.integers(0, 2),
    "stream": st.booleans(),
    "exclude_input_in_output": st.booleans(),
    "beam_width": st.just(1),
    "stop_words": st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "sampling_param_temperature": st.floats(0, 2),
    "sampling_param_top_p": st.floats(0.01, 1),
    "sampling_param_seed": st.integers(0, 2**64 - 1),
    "streaming": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "return_log_probs": st.booleans(),
    "return_prompt_log_probs": st.booleans(),
    "sampling_param_return_perf_metrics": st.booleans(),
}


@st.composite
def grpc_input(draw, name: str, clean: bool):
    """(name, dtype, numpy array): mostly the declared type and shape [1, 1], sometimes anything; clean: a
    valid value of the declared type and shape."""
    declared = KNOWN.get(name, draw(st.sampled_from(WIRE_TYPES)))
    dtype = declared if clean or draw(st.integers(0, 4)) else draw(st.sampled_from(WIRE_TYPES))
    shape = [1, 1] if clean or draw(st.integers(0, 4)) else draw(st.lists(st.integers(0, 3), max_size=3))
    size = int(np.prod(shape)) if shape else 1
    if dtype == "BYTES":
        if name == "text_input" and (clean or draw(st.booleans())):
            values = [draw(st.sampled_from([b"Hello", b"The capital of France is", b"Once upon a time"]))] * size
        else:
            values = draw(st.lists(odd_bytes, min_size=size, max_size=size))
        array = np.array(values, dtype=np.object_).reshape(shape)
    elif dtype == "BOOL":
        array = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=np.bool_).reshape(shape)
    else:
        np_type = NUMPY_TYPES[dtype]
        if name in fast_valid and dtype == declared and (clean or draw(st.booleans())):
            number = draw(fast_valid[name])
        else:
            number = draw(odd_number)
        with np.errstate(all="ignore"):
            try:
                array = np.full(shape, number).astype(np_type)
            except (OverflowError, ValueError):
                array = np.full(shape, 0, dtype=np_type)
    return name, dtype, array


@st.composite
def grpc_request(draw):
    """A list of inputs: a usual request with some inputs made odd, unknown or duplicated (a third are valid)."""
    clean = not draw(st.integers(0, 2))
    names = ["text_input"] if clean or draw(st.integers(0, 5)) else []
    names += draw(
        st.lists(
            st.sampled_from(sorted(set(KNOWN) - {"stop", "text_input"} if clean else KNOWN)), max_size=5, unique=True
        )
    )
    if not clean and not draw(st.integers(0, 6)):
        names.append(draw(st.sampled_from(["foo", "TEXT_INPUT", "text_input ", "ünïcødé", "max_tokens\x00"])))
    if names and not clean and not draw(st.integers(0, 8)):
        names.append(draw(st.sampled_from(names)))  # duplicated
    inputs = [draw(grpc_input(n, clean)) for n in names]
    if "max_tokens" not in names:  # the default (16) would make valid cases slow
        inputs.append(("max_tokens", "INT32", np.array([[draw(st.integers(1, MAX_FAST_TOKENS))]], dtype=np.int32)))
    return inputs


def _as_json(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), odd_text, st.floats(allow_nan=False, allow_infinity=False)
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def http_body(draw):
    """(raw body bytes, names sent): JSON objects with odd values, or raw bytes that are barely JSON."""
    if not draw(st.integers(0, 9)):
        raw = draw(
            st.sampled_from(
                [
                    b"",
                    b"{",
                    b"[]",
                    b"null",
                    b'{"text_input": "\xff\xfe"}',
                    b"\xc3\x28",
                    b'{"text_input": "a", "text_input": "b", "max_tokens": 1}',
                    b'{"text_input": "Hi", "max_tokens": NaN}',
                    b'{"max_tokens": 1e999}',
                ]
            )
        )
        return raw, None
    body = {}
    if draw(st.integers(0, 5)):
        body["text_input"] = draw(st.one_of(st.sampled_from(["Hello", "The capital of France is"]), json_value))
    for name in draw(st.lists(st.sampled_from(sorted(KNOWN) + ["foo", "id", "parameters"]), max_size=5, unique=True)):
        body[name] = draw(st.one_of(fast_valid[name], json_value) if name in fast_valid else json_value)
    body.setdefault("max_tokens", draw(st.integers(1, MAX_FAST_TOKENS)))
    return json.dumps(body).encode(), sorted(body)


# --- transports --------------------------------------------------------------------------------------------------
class Stream:
    """One long-lived gRPC stream; each case's events are told apart by request id."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        self.ids = itertools.count()

    def call(self, inputs: list, stop: bool = False, timeout: float = 60.0) -> tuple[list, str | None]:
        """Send one request; (responses, error) up to its final response or error."""
        rid = f"fuzz-{next(self.ids)}"
        tensors = []
        for name, dtype, array in inputs:
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            tensors.append(t)
        self.client.async_stream_infer(MODEL, tensors, request_id=rid, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = self.events.get(timeout=timeout)
            if error is not None:
                return responses, error.message()
            got = result.get_response()
            assert got.id == rid, f"a response for {got.id!r} arrived while waiting for {rid!r}"
            responses.append(got)
            if got.parameters["triton_final_response"].bool_param:
                return responses, None

    def assert_quiet(self, wait_s: float = 0.0) -> None:
        """Nothing arrived after the last final response (no second final, no late error)."""
        try:
            result, error = self.events.get(timeout=wait_s) if wait_s else self.events.get_nowait()
        except queue.Empty:
            return
        raise AssertionError(f"stray event after a final response: {result and result.get_response()}, {error}")

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def http_generate(server, body: bytes, stream: bool) -> tuple[int, str]:
    path = "generate_stream" if stream else "generate"
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


TRITON_PARSE_ERROR = re.compile(
    r"failed to parse the request JSON|Unable to parse|attempt to (get|access)|"
    r"Expected JSON"
)


def error_of(text: str) -> str:
    """The one error of a JSON or SSE error body."""
    if text.startswith("data: "):
        (event,) = [line for line in text.splitlines() if line.startswith("data: ")]
        return json.loads(event[len("data: ") :])["error"]
    return json.loads(text)["error"]


def ready(server) -> bool:
    return http_ready(server.http_url)


# NOTE: Triton's own check of the batch dimension (the first of every input: config.pbtxt's max_batch_size 1)
# speaks of the request's batch size, not of one input (seed 7 found it with a max_tokens of shape [2]).
TRITON_REQUEST_ERRORS = ("inference request batch-size must be <= 1",)


def names_an_input(message: str, names) -> bool:
    """The error names an input the client sent, or one of the model's (a required one it left out)."""
    if any(e in message for e in TRITON_REQUEST_ERRORS):
        return True
    names = set(names) | set(KNOWN)
    return any(f"'{n}'" in message or f"{n}:" in message or f"'{n}" in message for n in names)


# Cached prefix blocks are free blocks that still hold a reusable prefix: they grow with traffic by design,
# and the free count (which includes them) is what shows a leak.
NOT_IDLE_ACCOUNT = ('morphserve_kv_cache_blocks{type="cached"}',)


def idle_account(server) -> dict[str, float]:
    m = settled_metrics(server)
    return {
        k: v
        for k, v in m.items()
        if k.startswith(("morphserve_kv_cache_blocks", "morphserve_memory_bytes", "morphserve_requests{"))
        and k not in NOT_IDLE_ACCOUNT
    }


@pytest.fixture(scope="module")
def idle_before(triton_server):
    return idle_account(triton_server)


def assert_back_to_idle(server, before: dict[str, float]) -> None:
    deadline = time.monotonic() + 15
    while True:
        after = idle_account(server)
        if after == before or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after.get('morphserve_kv_cache_blocks{type="used"}') == 0, after
    assert after == before, {
        k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)
    }


# --- the properties ----------------------------------------------------------------------------------------------
def run_seeded(case) -> None:
    """Run a hypothesis test; a failure carries the seed that replays it (pytest shows exception notes)."""
    try:
        case()
    except BaseException as exc:
        exc.add_note(f"[fuzz] seed {SEED}: replay with MORPHSERVE_FUZZ_SEED={SEED}")
        raise


def test_fuzz_grpc_stream(triton_server, idle_before):
    stream = Stream(triton_server.grpc_url)
    counts = {"final": 0, "error": 0, "stop": 0}

    @seed(SEED)
    @FUZZ
    @given(grpc_request(), st.integers(0, 15))
    def case(inputs, stop_draw):
        if stop_draw == 0:  # `stop` for an id nobody uses, possibly beside other inputs
            inputs = [("stop", "BOOL", np.array([[True]]))] + inputs
            counts["stop"] += 1
        responses, error = stream.call(inputs)
        names = {name for name, _, _ in inputs}
        if error is not None:
            counts["error"] += 1
            assert names_an_input(error, names), f"the error names none of {sorted(names)}: {error}"
        else:
            counts["final"] += 1
            finals = [r for r in responses if r.parameters["triton_final_response"].bool_param]
            assert len(finals) == 1
        stream.assert_quiet()
        assert ready(triton_server)

    try:
        run_seeded(case)
        stream.assert_quiet(wait_s=0.5)
    finally:
        stream.close()
    print(f"[fuzz] gRPC: {counts}")
    assert counts["final"] and counts["error"]  # both paths were exercised
    assert_back_to_idle(triton_server, idle_before)


def test_fuzz_http(triton_server, idle_before):
    counts = {"ok": 0, "rejected": 0, "triton_500": 0, "stream_on_generate": 0}

    @seed(SEED)
    @FUZZ
    @given(http_body(), st.booleans())
    # found by a run: a `stream` input sent to the one-response endpoint
    @example(
        (b'{"text_input": "Hello", "stream": true, "max_tokens": 2}', ["max_tokens", "stream", "text_input"]), False
    )
    def case(body_names, stream):
        body, names = body_names
        status, text = http_generate(triton_server, body, stream)
        if status == 500:
            # NOTE: Triton 2.51's HTTP frontend answers a body it cannot parse, or a JSON value of the wrong type,
            # with 500 and a message about 'data' rather than the input (the gRPC path names it)
            assert TRITON_PARSE_ERROR.search(error_of(text)), text
            counts["triton_500"] += 1
        elif status == 400:
            counts["rejected"] += 1
            error = error_of(text)
            if names is not None:  # a JSON object: the error names one of its fields
                assert names_an_input(error, names), (body[:200], error)
        else:
            assert status == 200, (status, text)
            counts["ok"] += 1
            if stream:
                events = [line for line in text.splitlines() if line.startswith("data: ")]
                errors = [e for e in events if '"error"' in e]
                assert events and (not errors or errors == events[-1:]), text[:500]  # an error can only end it
            else:
                reply = json.loads(text)
                if "error" in reply and b'"stream"' in body:
                    # NOTE: a `stream` input on the one-response `generate` endpoint makes the model stream; Triton
                    # 2.51 answers that generate expects exactly one response and points to generate_stream
                    assert "generate stream" in reply["error"], reply
                    counts["stream_on_generate"] += 1
                else:
                    assert "text_output" in reply, reply
        assert ready(triton_server)

    run_seeded(case)
    print(f"[fuzz] HTTP: {counts}")
    assert counts["ok"] and counts["rejected"]
    assert_back_to_idle(triton_server, idle_before)


def test_found_by_fuzzing_a_vanishing_temperature_is_served(triton_server):
    """Seed 20261201 found it: temperature 1e-45 made the sampler's probabilities nan; multinomial raised in the
    engine thread, which died, and every later request hung. Now it samples greedily (and a failing
    iteration fails only its own requests: tests/engine/test_faults_engine.py)."""
    stream = Stream(triton_server.grpc_url)
    try:
        for t in (1e-45, 1e-38, 3.4e38):
            responses, error = stream.call(
                [
                    ("text_input", "BYTES", np.array([[b"The capital of France is"]], dtype=np.object_)),
                    ("max_tokens", "INT32", np.array([[3]], dtype=np.int32)),
                    ("temperature", "FP32", np.array([[t]], dtype=np.float32)),
                ],
                timeout=30,
            )
            assert error is None and responses, (t, error)
    finally:
        stream.close()
