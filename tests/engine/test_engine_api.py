"""The engine's public API for tools: abort_all, forced morph actions through EngineConfig, settle_morph, and
stats() that reads without side effects."""

from __future__ import annotations

import threading

import pytest
from tests.engine_fixtures import PROMPTS, fragment_dir, make_engine

from trtllm_backend.config import EngineConfig
from trtllm_backend.outputs import EngineStats
from trtllm_backend.sampling import SamplingParams


def add(engine, n, max_tokens=50):
    finals = {}
    done = threading.Event()

    def on_output(o):
        if o.finished:
            finals[o.request_id] = o.finish_reason
            if len(finals) == n:
                done.set()

    for i in range(n):
        engine.add_request(
            PROMPTS[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True), on_output, request_id=f"r{i}"
        )
    return finals, done


@pytest.mark.needs_model
def test_abort_all_on_the_calling_thread():
    engine = make_engine()
    finals, _ = add(engine, 3)
    engine.step()  # admitted and prefilled
    assert engine.pool.num_used > 0
    engine.abort_all()
    assert finals == {"r0": "abort", "r1": "abort", "r2": "abort"}
    assert engine.pool.num_used == 0 and not engine.scheduler.has_work() and not engine.requests


@pytest.mark.needs_model
def test_abort_all_with_the_engine_thread_running():
    engine = make_engine()
    engine.start()
    try:
        finals, done = add(engine, 2, max_tokens=200)
        engine.abort_all()
        assert done.wait(30)
        assert set(finals.values()) == {"abort"}
    finally:
        engine.shutdown()
    assert engine.pool.num_used == 0


@pytest.mark.needs_model
def test_force_morph_is_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match="force_morph: cannot parse 'sideways:2@1'"):
        EngineConfig(fragment_dir=str(fragment_dir()), force_morph="down:1@0,sideways:2@1")


@pytest.mark.needs_model
def test_forced_swaps_settle_and_stats_read_without_side_effects(layer_set):
    engine = make_engine(force_morph="down:2@0", fragment_dir=str(layer_set))
    assert engine.num_quantized_layers() == 0  # nothing happens before an iteration
    assert engine.settle_morph(timeout_s=120)
    assert engine.num_quantized_layers() == 2 and not engine.morph.busy(engine.counters.iterations)
    first, second = engine.stats(), engine.stats()
    assert first.int4_layers == 2 and first.swaps_down == 2
    assert first.swaps_timed == second.swaps_timed == 2 and first.swap_timings == second.swap_timings
    # each swap really timed: a prepare (staging the fragment) and an apply (rebinding, growing the KV pool) that
    # both took time, within the settle above
    assert len(first.swap_timings) == 2 and all(0 < p < 120 and 0 < a < 120 for p, a in first.swap_timings)
    assert first.timings_since(1) == [first.swap_timings[1]] and first.timings_since(2) == []
    # Generation goes on with the swapped layers.
    outs = list(engine.generate("The capital of France is", SamplingParams(max_tokens=3)))
    assert all(s == 2 for o in outs for s in o.int4_layers)


@pytest.mark.needs_model
def test_settle_morph_refuses_while_the_engine_thread_runs():
    engine = make_engine()
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="engine thread is running"):
            engine.settle_morph()
    finally:
        engine.shutdown()


def test_timings_since_keeps_a_cursor_over_a_bounded_window():
    s = EngineStats(swap_timings=((0.3, 0.03), (0.4, 0.04)), swaps_timed=7)  # swaps 6 and 7 still held
    assert s.timings_since(5) == [(0.3, 0.03), (0.4, 0.04)]
    assert s.timings_since(6) == [(0.4, 0.04)]
    assert s.timings_since(0) == [(0.3, 0.03), (0.4, 0.04)]  # older ones fell out of the window
    assert s.timings_since(7) == []
