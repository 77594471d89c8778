"""Unit tests of the Triton glue (model.py) with a fake `triton_python_backend_utils` and a fake engine.

The fake engine is driven by hand (`engine.step()`), so every response order is deterministic.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import time
import types

import numpy as np
import pytest

from tests import ROOT
from trtllm_backend.errors import InvalidRequest, QueueFull
from trtllm_backend.outputs import EngineStats, RequestOutput, RequestTimings
from trtllm_backend.triton.params import PARAMS, ParamError

MODEL_PY = ROOT / "model_repository" / "smollm2" / "1" / "model.py"
FINAL = 1


# --- fake triton_python_backend_utils ---------------------------------------------------------------------------
class FakeTritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=0):
        super().__init__(message)
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeResponse:
    def __init__(self, output_tensors=None, error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors or []}
        self.error = error


class FakeSender:
    def __init__(self):
        self.sent: list[tuple[FakeResponse | None, int]] = []
        self.cancelled = False

    def send(self, response=None, flags=0):
        assert not self.finished, "a response after the final one"
        self.sent.append((response, flags))

    violations: list[str] = []  # Triton 2.51 segfaults when a finished request's response factory is polled

    def is_cancelled(self):
        if self.finished:
            FakeSender.violations.append("is_cancelled() after the final response")
        return self.cancelled

    @property
    def finished(self):
        return any(flags & FINAL for _, flags in self.sent)

    def texts(self):
        return [r.outputs["text_output"][0][0].decode() for r, _ in self.sent if r is not None and r.error is None]

    @property
    def error(self):
        errors = [r.error for r, _ in self.sent if r is not None and r.error is not None]
        return errors[0] if errors else None


class FakeRequest:
    def __init__(self, inputs: dict[str, np.ndarray], request_id: str = ""):
        self.inputs = inputs
        self._id = request_id
        self.sender = FakeSender()

    def request_id(self):
        return self._id

    def get_response_sender(self):
        return self.sender


class FakeMetric:
    def __init__(self, labels, buckets):
        self.labels, self.buckets = labels, buckets
        self.value, self.observations = 0.0, []

    def set(self, v):
        self.value = v

    def increment(self, v):
        assert v >= 0
        self.value += v

    def observe(self, v):
        self.observations.append(v)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, "FakeMetricFamily"] = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeMetricFamily.created[name] = self

    def Metric(self, labels=None, buckets=None):  # noqa: N802  (Triton's spelling)
        assert (buckets is not None) == (self.kind == self.HISTOGRAM)
        metric = FakeMetric(labels or {}, buckets)
        self.metrics.append(metric)
        return metric

    def get(self, **labels):
        (metric,) = [m for m in self.metrics if all(m.labels.get(k) == v for k, v in labels.items())]
        return metric


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError = FakeTritonError
    pb.TritonModelException = type("TritonModelException", (Exception,), {})
    pb.Tensor = FakeTensor
    pb.InferenceResponse = FakeResponse
    pb.MetricFamily = FakeMetricFamily
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.get_input_tensor_by_name = lambda req, name: FakeTensor(name, req.inputs[name]) if name in req.inputs else None
    pb.using_decoupled_model_transaction_policy = lambda cfg: cfg.get("model_transaction_policy", {}).get("decoupled")
    return pb


# --- fake engine ------------------------------------------------------------------------------------------------
class FakeEngine:
    """Emits one word per step for each request; validates like the real engine would."""

    def __init__(self, max_queue_size=4, max_len=100):
        self.requests: dict[str, dict] = {}
        self.max_queue_size, self.max_len = max_queue_size, max_len
        self.started = self.shut_down_with = None

    def start(self):
        self.started = True

    def add_request(self, prompt, params, on_output, request_id=None):
        if params.max_tokens > self.max_len:
            raise InvalidRequest("max_tokens", f"{params.max_tokens} exceeds the context ({self.max_len})")
        if len(prompt) > 1000:
            raise InvalidRequest("prompt", "longer than the KV pool")
        if len(self.requests) >= self.max_queue_size:
            raise QueueFull(f"{self.max_queue_size} requests waiting")
        self.requests[request_id] = dict(params=params, cb=on_output, n=0, t=RequestTimings(arrival=time.monotonic()))
        return request_id

    def step(self):
        for rid, r in list(self.requests.items()):
            r["n"] += 1
            now = time.monotonic()
            r["t"].scheduled = r["t"].scheduled or now
            r["t"].first_token = r["t"].first_token or now
            done = r["n"] >= r["params"].max_tokens
            if done:
                r["t"].finished = now
                del self.requests[rid]
            r["cb"](
                RequestOutput(
                    rid,
                    f" w{r['n']}",
                    [100 + r["n"]],
                    [3],
                    finished=done,
                    finish_reason="length" if done else None,
                    num_prompt_tokens=2,
                    num_output_tokens=r["n"],
                    timings=r["t"],
                )
            )

    def fail(self, rid):
        r = self.requests.pop(rid)
        r["cb"](RequestOutput(rid, "", [], [], finished=True, finish_reason="error", error="boom", timings=r["t"]))

    def abort(self, rid):
        r = self.requests.pop(rid, None)
        if r is None:
            return False
        r["cb"](
            RequestOutput(
                rid, "", [], [], finished=True, finish_reason="abort", num_output_tokens=r["n"], timings=r["t"]
            )
        )
        return True

    def stats(self):
        return EngineStats(
            running=len(self.requests),
            kv_blocks_total=10,
            kv_blocks_used=2 * len(self.requests),
            kv_blocks_free=10 - 2 * len(self.requests),
            prompt_tokens=7,
            generation_tokens=5,
            swap_timings=((0.01, 0.002),),
            swaps_timed=1,
        )

    def shutdown(self, drain_timeout_s=5.0):
        self.shut_down_with = drain_timeout_s
        for rid in list(self.requests):
            self.abort(rid)


# --- fixtures ---------------------------------------------------------------------------------------------------
def model_config(params: dict[str, str] | None = None, decoupled=True) -> str:
    raw = {p.name: p.default for p in PARAMS} | {"cancel_poll_interval_s": "0.01", "metrics_interval_s": "0.01"}
    raw |= params or {}
    return json.dumps(
        {
            "name": "smollm2",
            "model_transaction_policy": {"decoupled": decoupled},
            "parameters": {k: {"string_value": v} for k, v in raw.items()},
        }
    )


@pytest.fixture
def model_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    FakeMetricFamily.created.clear()
    spec = importlib.util.spec_from_file_location("smollm2_model_under_test", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    engine = FakeEngine()
    monkeypatch.setattr(module, "create_engine", lambda config: engine)
    module.fake_engine = engine
    return module


def test_model_does_not_patch_sys_path():
    """model.py imports the project from the environment it runs in (the editable install, or the Docker
    image's .pth file); a sys.path edit would hide a broken install."""
    tree = ast.parse(MODEL_PY.read_text())
    uses = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"
    ]
    assert uses == [], f"model.py touches sys.path at lines {uses}"


def load(module, params=None, decoupled=True):
    model = module.TritonPythonModel()
    model.initialize(
        {
            "model_config": model_config(params, decoupled),
            "model_repository": "/models/smollm2",
            "model_version": "1",
            "model_name": "smollm2",
        }
    )
    return model


@pytest.fixture
def model(model_module):
    FakeSender.violations.clear()
    m = load(model_module)
    yield m
    if not m.stopping.is_set():
        m.finalize()
    assert not FakeSender.violations


def text(s: str) -> np.ndarray:
    return np.array([[s.encode()]], dtype=np.object_)


def scalar(v, dtype) -> np.ndarray:
    return np.array([[v]], dtype=dtype)


def run(model, *requests):
    assert model.execute(list(requests)) is None
    model.outbox.join()
    return requests


def step(model, fn=None):
    """One engine action, then wait until the responder thread has sent what it produced."""
    (fn or model.engine.step)()
    model.outbox.join()


def drain(model, steps=50):
    for _ in range(steps):
        if not model.engine.requests:
            return
        step(model)


# --- load -------------------------------------------------------------------------------------------------------
def test_initialize_starts_engine_and_threads(model):
    assert model.engine.started
    assert all(t.is_alive() for t in model.threads)
    assert model.params.engine["fragment_dir"] == "/models/smollm2/1/fragments"


@pytest.mark.parametrize(
    "name,value",
    [
        ("block_size", "0"),
        ("max_queue_size", "many"),
        ("default_top_p", "2"),
        ("device", "tpu"),
        ("no_such_param", "1"),
        ("max_tokens_in_paged_kv_cache", "8"),
    ],
)  # EngineConfig's own check
def test_bad_parameter_fails_load_naming_it(model_module, name, value):
    with pytest.raises(ParamError, match=f"'{name}'"):
        load(model_module, {name: value})


def test_non_decoupled_config_is_refused(model_module):
    with pytest.raises(Exception, match="decoupled"):
        load(model_module, decoupled=False)


# --- streaming and single responses ------------------------------------------------------------------------------
def test_streaming_sends_deltas_then_final(model):
    (req,) = run(
        model,
        FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(3, np.int32), "stream": scalar(True, np.bool_)}),
    )
    drain(model)
    assert req.sender.texts() == [" w1", " w2", " w3"]
    assert [f for _, f in req.sender.sent] == [0, 0, FINAL]
    counts = [int(r.outputs["output_token_count"][0][0]) for r, _ in req.sender.sent]
    assert counts == [1, 1, 1]
    assert req.sender.sent[0][0].outputs["int4_layers"].tolist() == [[3]]


def test_llmapi_streaming_sends_the_whole_text_so_far(model):
    (req,) = run(
        model,
        FakeRequest(
            {
                "text_input": text("Hi"),
                "sampling_param_max_tokens": scalar(3, np.int32),
                "streaming": scalar(True, np.bool_),
                "sampling_param_return_perf_metrics": scalar(True, np.bool_),
            }
        ),
    )
    drain(model)
    assert req.sender.texts() == [" w1", " w1 w2", " w1 w2 w3"]
    assert all("arrival_time_ns" in r.outputs and "kv_cache_hit_rate" in r.outputs for r, _ in req.sender.sent)


def test_single_response_echoes_prompt_unless_excluded(model):
    a, b = run(
        model,
        FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(2, np.int32)}),
        FakeRequest(
            {
                "text_input": text("Hi"),
                "max_tokens": scalar(2, np.int32),
                "exclude_input_in_output": scalar(True, np.bool_),
            }
        ),
    )
    drain(model)
    assert a.sender.texts() == ["Hi w1 w2"] and b.sender.texts() == [" w1 w2"]
    response, flags = a.sender.sent[0]
    assert flags == FINAL and int(response.outputs["output_token_count"][0][0]) == 2
    assert response.outputs["int4_layers"].tolist() == [[3, 3]]


def test_defaults_apply_when_inputs_are_missing(model_module):
    model = load(model_module, {"default_max_tokens": "4"})
    (req,) = run(model, FakeRequest({"text_input": text("Hi")}))
    drain(model)
    assert req.sender.texts() == ["Hi w1 w2 w3 w4"]
    model.finalize()


@pytest.mark.parametrize(
    "name,value",
    [
        ("max_tokens", np.array([2], dtype=np.int64)),  # shape [1], another width
        ("max_tokens", np.array([[2.0]], dtype=np.float32)),  # an integral float
        ("temperature", np.array([[0]], dtype=np.int32)),
        ("top_p", np.array([0.5], dtype=np.float64)),
        ("random_seed", np.array([[2**63 + 5]], dtype=np.uint64)),
        ("stream", np.array([[1]], dtype=np.int8)),
        ("stop_words", np.array([[b"", b"\n\n"]], dtype=np.object_)),
    ],
)
def test_inputs_accept_shapes_and_widths(model, name, value):
    (req,) = run(model, FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(2, np.int32), name: value}))
    drain(model)
    assert req.sender.error is None and req.sender.finished


# --- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "inputs,field",
    [
        ({}, "text_input"),
        ({"text_input": text("")}, "text_input"),
        ({"text_input": np.array([[b"\xff\xfe"]], dtype=np.object_)}, "text_input"),
        ({"text_input": np.array([[b"a", b"b"]], dtype=np.object_)}, "text_input"),
        ({"text_input": np.array([[1]], dtype=np.int32)}, "text_input"),
        ({"max_tokens": scalar(2.5, np.float32)}, "max_tokens"),
        ({"max_tokens": scalar(0, np.int32)}, "max_tokens"),
        ({"max_tokens": np.array([[1, 2]], dtype=np.int32)}, "max_tokens"),
        ({"max_tokens": scalar(1000, np.int32)}, "max_tokens"),  # beyond the (fake) context
        ({"max_tokens": text("3")}, "max_tokens"),
        ({"temperature": scalar(-1, np.float32)}, "temperature"),
        ({"temperature": scalar(np.nan, np.float32)}, "temperature"),
        ({"top_k": scalar(-2, np.int32)}, "top_k"),
        ({"top_p": scalar(0.0, np.float32)}, "top_p"),
        ({"min_length": scalar(-1, np.int32)}, "min_length"),
        ({"stream": scalar(3, np.int32)}, "stream"),
        ({"stop_words": scalar(3, np.int32)}, "stop_words"),
        ({"beam_width": scalar(4, np.int32)}, "beam_width"),
        ({"text_input": text("x" * 2000)}, "text_input"),  # the engine's "prompt" renamed
    ],
)
def test_bad_input_gets_invalid_arg_naming_the_field(model, inputs, field):
    inputs = {"text_input": text("Hi")} | inputs if inputs else {}
    (req,) = run(model, FakeRequest(inputs))
    error = req.sender.error
    assert error is not None and error.code() == FakeTritonError.INVALID_ARG
    assert error.message().startswith(f"{field}: "), error.message()
    assert req.sender.finished and not model.live
    # ... and the model keeps serving.
    (ok,) = run(model, FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(1, np.int32)}))
    drain(model)
    assert ok.sender.texts() == ["Hi w1"]


def test_queue_full_is_unavailable_and_running_requests_continue(model):
    running = run(
        model, *[FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(2, np.int32)}) for _ in range(4)]
    )
    (extra,) = run(model, FakeRequest({"text_input": text("Hi")}))
    assert extra.sender.error.code() == FakeTritonError.UNAVAILABLE and extra.sender.finished
    drain(model)
    assert all(r.sender.texts() == ["Hi w1 w2"] for r in running)


def test_engine_error_becomes_an_internal_error_response(model):
    (req,) = run(model, FakeRequest({"text_input": text("Hi"), "stream": scalar(True, np.bool_)}))
    step(model, lambda: model.engine.fail(next(iter(model.engine.requests))))
    assert req.sender.error.code() == FakeTritonError.INTERNAL and req.sender.finished
    assert not model.live


# --- cancellation -----------------------------------------------------------------------------------------------
def test_stop_input_cancels_the_request_with_the_same_id(model):
    (req,) = run(
        model,
        FakeRequest(
            {"text_input": text("Hi"), "max_tokens": scalar(50, np.int32), "stream": scalar(True, np.bool_)},
            request_id="r-7",
        ),
    )
    step(model)
    (stop,) = run(model, FakeRequest({"stop": scalar(True, np.bool_)}, request_id="r-7"))
    assert stop.sender.finished and stop.sender.error is None
    assert req.sender.finished and req.sender.texts() == [" w1"]
    assert not model.engine.requests and not model.live


def test_cancelled_client_is_aborted_by_the_watcher(model):
    (req,) = run(
        model,
        FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(50, np.int32), "stream": scalar(True, np.bool_)}),
    )
    step(model)
    req.sender.cancelled = True
    deadline = time.monotonic() + 2
    while model.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    model.outbox.join()
    assert not model.engine.requests and req.sender.finished
    cancelled = FakeMetricFamily.created["morphserve_requests_total"].get(status="cancelled")
    assert cancelled.value == 1


# --- metrics ----------------------------------------------------------------------------------------------------
def test_metrics_families_and_updates(model):
    fams = FakeMetricFamily.created
    for name in (
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
    ):
        assert name in fams and name in model.metrics.families  # referenced, never collected
    assert fams["morphserve_kv_capacity_blocks"].get().value == 8192 // 16
    run(model, *[FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(3, np.int32)}) for _ in range(2)])
    deadline = time.monotonic() + 2
    while fams["morphserve_requests"].get(state="active").value != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fams["morphserve_requests"].get(state="active").value == 2
    assert fams["morphserve_kv_cache_blocks"].get(type="used").value == 4
    assert fams["morphserve_prompt_tokens_total"].get().value == 7  # advanced once, not per update
    assert fams["morphserve_swap_apply_seconds"].get().observations == [0.002]  # one swap, observed once
    drain(model)
    assert len(fams["morphserve_time_to_first_token_seconds"].get().observations) == 2
    assert len(fams["morphserve_time_per_output_token_seconds"].get().observations) == 2
    assert fams["morphserve_requests_total"].get(status="success").value == 2
    assert fams["morphserve_time_to_first_token_seconds"].get().labels == {"model": "smollm2", "version": "1"}


def test_rejected_requests_count_as_errors(model):
    run(model, FakeRequest({"text_input": text("")}))
    assert FakeMetricFamily.created["morphserve_requests_total"].get(status="error").value == 1
    assert not FakeMetricFamily.created["morphserve_time_to_first_token_seconds"].get().observations


# --- finalize ---------------------------------------------------------------------------------------------------
def test_finalize_drains_joins_and_refuses_new_requests(model_module):
    model = load(model_module, {"drain_timeout_s": "1.5"})
    (req,) = run(
        model,
        FakeRequest({"text_input": text("Hi"), "max_tokens": scalar(50, np.int32), "stream": scalar(True, np.bool_)}),
    )
    model.finalize()
    assert model.engine.shut_down_with == 1.5
    assert req.sender.finished  # aborted by the drain: the client still got its final response
    assert not any(t.is_alive() for t in model.threads)
    (late,) = run(model, FakeRequest({"text_input": text("Hi")}))
    assert late.sender.error.code() == FakeTritonError.UNAVAILABLE
