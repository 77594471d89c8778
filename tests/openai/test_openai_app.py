"""The gateway's HTTP surface without a model: routing, auth, errors in OpenAI's shape, its own metrics.

Requests here are refused before they would reach Triton, or find no Triton listening (a closed port): the
integration tests with a real tritonserver are in test_openai_server.py.
"""

import pytest
from tests import ROOT
from fastapi.testclient import TestClient

from trtllm_backend.openai.app import GatewayConfig, create_app
from trtllm_backend.openai.triton_client import triton_error
from trtllm_backend.triton.server import free_ports

FRAGMENTS = ROOT / "model_repository" / "smollm2" / "1" / "fragments"
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def client(**overrides) -> TestClient:
    closed_port = free_ports(1)[0]  # nothing listens there
    config = GatewayConfig(triton_url=f"localhost:{closed_port}", fragment_dir=FRAGMENTS, **overrides)
    return TestClient(create_app(config))


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.needs_model
def test_models_and_unknown_model():
    with client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["smollm2"]
        assert c.get("/v1/models/smollm2").json()["object"] == "model"
        assert error_of(c.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"
        err = error_of(c.post("/v1/chat/completions", json=CHAT | {"model": "gpt-4"}), 404)
        assert err["param"] == "model" and "gpt-4" in err["message"]


@pytest.mark.needs_model
def test_bad_bodies_are_400s_naming_the_field():
    with client() as c:
        assert error_of(c.post("/v1/chat/completions", content=b"{not json"), 400)["param"] == "body"
        assert error_of(c.post("/v1/completions", json=["a"]), 400)["param"] == "body"
        err = error_of(c.post("/v1/chat/completions", json=CHAT | {"temperature": -1}), 400)
        assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
        err = error_of(c.post("/v1/completions", json={"model": "smollm2", "prompt": "x", "n": 3}), 400)
        assert err["param"] == "n" and "n=1" in err["message"]


@pytest.mark.needs_model
def test_unknown_routes_and_methods_keep_the_error_shape():
    with client() as c:
        error_of(c.get("/v1/nothing"), 404)
        error_of(c.get("/v1/chat/completions"), 405)


@pytest.mark.needs_model
def test_the_responses_api_is_refused_with_a_pointer_to_chat():
    with client() as c:
        err = error_of(c.post("/v1/responses", json={"model": "smollm2", "input": "hi"}), 404)
        assert err["code"] == "unsupported_endpoint" and "/v1/chat/completions" in err["message"]


@pytest.mark.needs_model
def test_api_key():
    with client(api_key="s3cret") as c:
        assert error_of(c.get("/v1/models"), 401)["code"] == "invalid_api_key"
        error_of(c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # Past the key check: the next refusal is about the body.
        ok_key = {"Authorization": "Bearer s3cret"}
        assert error_of(c.post("/v1/chat/completions", json=CHAT | {"n": 2}, headers=ok_key), 400)["param"] == "n"
        assert c.get("/health").status_code == 503 and c.get("/metrics").status_code == 200  # no key needed


@pytest.mark.needs_model
def test_no_triton_is_a_503_and_health_says_so():
    with client() as c:
        err = error_of(c.post("/v1/chat/completions", json=CHAT), 503)
        assert err["code"] == "triton_unavailable" and err["type"] == "server_error"
        assert c.get("/health").json()["status"] == "unavailable"


@pytest.mark.needs_model
def test_gateway_metrics_count_requests_by_status():
    with client() as c:
        c.post("/v1/chat/completions", json=CHAT | {"n": 2})
        c.post("/v1/chat/completions", json=CHAT | {"n": 2})
        text = c.get("/metrics").text
    assert 'openai_gateway_requests_total{endpoint="/v1/chat/completions",status="400"} 2.0' in text
    assert "openai_gateway_requests_in_flight 0.0" in text


@pytest.mark.parametrize(
    "message, status, param",
    [
        ("queue full: 20 requests waiting", 503, None),
        ("text_input: 9000 tokens, the model context is 8192", 400, "messages"),
        ("max_tokens: must be an integer >= 1, got 0", 400, "max_completion_tokens"),
        ("random_seed: must be an integer", 400, "seed"),
        ("stop_words: must be BYTES", 400, "stop"),
        ("frequency_penalty: must be a number in [-2, 2], got 9", 400, "frequency_penalty"),
        ("engine error: boom", 500, None),
    ],
)
def test_triton_errors_map_to_openai_statuses_and_field_names(message, status, param):
    err = triton_error(message, "messages", "max_completion_tokens")
    assert (err.status, err.param) == (status, param)
