"""An iteration that raises (a fault injected into the real engine's sampling step) fails only the requests it
was running, with an error; the engine thread lives on and serves the next request. Before this, the engine
thread died and every request hung (the fuzzer found one such input: tests/triton/test_fuzz_server.py)."""

import time

import pytest
from tests.engine_fixtures import make_engine

import trtllm_backend.engine as engine_module
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.needs_model


def _run(engine, prompt: str, timeout: float = 60.0) -> list:
    pieces = []
    engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), pieces.append)
    deadline = time.monotonic() + timeout
    while not (pieces and pieces[-1].finished) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pieces


def test_a_failing_iteration_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    real_sample, calls = engine_module.sample, []

    def sample_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: sampling failed")
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", sample_failing_once)
    engine = make_engine()
    engine.start()
    try:
        failed = _run(engine, "The capital of France is")
        served = _run(engine, "Once upon a time")
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert failed and failed[-1].finish_reason == "error" and "injected" in failed[-1].error
    assert served and served[-1].finish_reason == "length" and sum(len(p.token_ids) for p in served) == 6
    assert engine.pool.num_used == 0 and engine.check_invariants() == []
