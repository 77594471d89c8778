"""Faults injected into the morphing path of the real engine (real model, real fragments): a fragment missing
at swap time, a full fragment removed or corrupted between a swap down and its restore, the staging thread raising, a budget too small to stage, a restore blocked by live blocks for a
long time, and 100 requests cancelled mid-generation during a morph. In each, serving goes on, every request
ends exactly once, and the invariant checker finds nothing. (A corrupt fragment: tests/engine/test_morph.py; over
the wire with its metric: tests/triton/test_faults_server.py.)"""

import logging
import time

import pytest
from tests.engine_fixtures import PROMPTS, damaged_fragment_copy, layers_only_copy, make_engine

from trtllm_backend.config import EngineConfig
from trtllm_backend.controller import parse_forced
from trtllm_backend.engine import LLMEngine
from trtllm_backend.precision import Precision
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.needs_model


def submit(engine, n: int, max_tokens: int, prefix: str = "p") -> dict[str, list]:
    outs = {}
    for i in range(n):
        rid = f"{prefix}{i}"
        outs[rid] = []
        engine.add_request(
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            outs[rid].append,
            request_id=rid,
        )
    return outs


def assert_healthy(engine, outs: dict[str, list], reason: str | None = "length") -> None:
    """Every request ended exactly once (with `reason` when given), no block is held, no invariant broke."""
    for rid, pieces in outs.items():
        assert [p.finished for p in pieces].count(True) == 1 and pieces[-1].finished, rid
        if reason:
            assert pieces[-1].finish_reason == reason, (rid, pieces[-1].finish_reason)
    assert engine.pool.num_used == 0
    assert engine.counters.invariant_violations == 0 and engine.check_invariants() == []


def test_missing_fragment_at_swap_time_keeps_the_binding_and_swaps_the_next(tmp_path):
    dst, victim_layer = damaged_fragment_copy(tmp_path / "fragments", "missing")
    engine = LLMEngine(EngineConfig(fragment_dir=str(dst), morph_policy="full", force_morph="down:2@1"))
    outs = submit(engine, 3, 12)
    engine.run_until_idle()
    assert engine.settle_morph(timeout_s=120)
    assert engine.counters.swap_failures == 1
    assert engine.model.slots[victim_layer].precision == Precision.FULL  # the failed layer keeps its binding
    assert engine.num_quantized_layers() == 1  # the next layer in the order was swapped instead
    assert_healthy(engine, outs)


@pytest.mark.parametrize("damage", ["removed", "corrupted"])
def test_a_full_fragment_damaged_after_swap_down_fails_its_restore_once(tmp_path, caplog, damage):
    frags = layers_only_copy(tmp_path / "fragments")
    engine = make_engine(fragment_dir=str(frags), max_tokens_in_paged_kv_cache=512, force_morph="down:2@1")
    outs = submit(engine, 3, 10)
    engine.run_until_idle()
    assert engine.settle_morph(timeout_s=120) and engine.num_quantized_layers() == 2
    first, last = engine.morph.swapped_layers  # restores pop the last swapped first
    victim = frags / engine.manifest.fragment(last, Precision.FULL)["file"]
    data = victim.read_bytes()
    victim.unlink()  # a symlink into the shared set: never write through it
    if damage == "corrupted":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    blocks_before = engine.pool.num_blocks
    now = engine.counters.iterations
    engine.morph.controller.forced = parse_forced(f"up:1@{now + 2},up:1@{now + 12},up:1@{now + 24}")
    with caplog.at_level(logging.ERROR, logger="morphserve.morph"):
        more = submit(engine, 3, 40, prefix="q")  # serving goes on through the failed restore and the next ones
        engine.run_until_idle()
        assert engine.settle_morph(timeout_s=120)
    failures = [r.getMessage() for r in caplog.records if "cannot restore" in r.getMessage()]
    assert len(failures) == 1 and f"layer {last}" in failures[0], failures  # logged once, never retried
    assert engine.counters.swap_failures == 1 and engine.counters.swaps_up == 1
    assert engine.model.slots[last].precision == Precision.INT4  # serving at the precision it has
    assert engine.model.slots[first].precision == Precision.FULL  # the rest of the stack still restored
    assert engine.morph.morphed_units == 0  # the controller does not count it for another restore
    # The drained segment's memory came back as KV: the layer stays INT4, so its bytes are free.
    assert engine.pool.num_blocks >= blocks_before - engine.morph.blocks_per_layer
    assert engine.morph.account.used <= engine.morph.account.budget
    assert_healthy(engine, outs | more)


def test_the_staging_thread_raising_is_a_swap_failure_not_a_dead_engine(caplog):
    engine = make_engine(force_morph="down:1@1,down:1@6")
    load = engine.morph.store.load_layer
    calls = []

    def failing_once(layer, precision):  # a fault injected into the real loader
        calls.append(layer)
        if len(calls) == 1:
            raise RuntimeError("injected: allocation failed while staging")
        return load(layer, precision)

    engine.morph.store.load_layer = failing_once
    engine.start()  # the engine thread, as in the server
    try:
        with caplog.at_level(logging.ERROR, logger="morphserve.morph"):
            outs = submit(engine, 4, 24)
            finished = _wait_all(outs, 120)
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert finished, "requests did not finish: the engine thread died"
    assert engine.counters.swap_failures == 1 and engine.counters.swaps_down == 1
    assert any("injected" in r.getMessage() for r in caplog.records)
    assert_healthy(engine, outs)


def _wait_all(outs: dict[str, list], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p and p[-1].finished for p in outs.values()):
            return True
        time.sleep(0.05)
    return False


def test_a_budget_too_small_to_stage_gives_the_swap_up_once(caplog):
    engine = make_engine(force_morph="down:1@1")
    account = engine.morph.account
    account.budget = account.used  # no room left even for the staging reserve
    with caplog.at_level(logging.WARNING, logger="morphserve.morph"):
        outs = submit(engine, 2, 10)
        engine.run_until_idle()
        assert engine.settle_morph(timeout_s=30)  # not busy forever
    assert engine.num_quantized_layers() == 0 and engine.counters.swaps_down == 0
    assert len([r for r in caplog.records if "no room to stage" in r.getMessage()]) == 1
    assert_healthy(engine, outs)


def test_a_restore_blocked_by_live_blocks_waits_and_serving_goes_on(layer_set):
    # A small base pool: after one swap the long requests spill into the added segment. The restore at
    # iteration 40 cannot move their blocks anywhere (the base pool is full), so it waits while they generate.
    engine = make_engine(
        max_tokens_in_paged_kv_cache=256, max_batch_size=8, force_morph="down:1@0,up:1@40", fragment_dir=str(layer_set)
    )
    assert engine.settle_morph(timeout_s=120) and engine.num_quantized_layers() == 1
    _, added = engine.pool.segments
    outs = submit(engine, 6, 80)
    blocked_iterations = 0
    while True:
        engine.step()
        if not engine.scheduler.has_work():
            break
        if engine.morph.draining is added and engine.scheduler.running:
            blocked_iterations += 1
    assert blocked_iterations >= 20, blocked_iterations  # blocked for a long time, serving meanwhile
    assert engine.settle_morph(timeout_s=120)
    assert engine.counters.swaps_up == 1 and engine.num_quantized_layers() == 0 and added not in engine.pool.segments
    assert_healthy(engine, outs)


def test_a_storm_of_100_cancellations_during_a_morph(layer_set):
    engine = make_engine(max_queue_size=128, max_batch_size=32, force_morph="down:2@2", fragment_dir=str(layer_set))
    engine.start()
    try:
        outs = submit(engine, 100, 200)
        deadline = time.monotonic() + 120
        while engine.counters.swaps_down < 1 and time.monotonic() < deadline:  # mid-morph, mid-generation
            time.sleep(0.01)
        assert engine.counters.swaps_down >= 1
        for rid in outs:  # as 100 clients closing their streams
            engine.abort(rid)
        assert _wait_all(outs, 60)
        while engine.counters.swaps_down < 2 and time.monotonic() < deadline:  # the morph completes regardless
            time.sleep(0.01)
    finally:
        engine.shutdown(drain_timeout_s=5)
    assert engine.counters.swaps_down == 2 and engine.num_quantized_layers() == 2
    assert all(p[-1].finish_reason == "abort" for p in outs.values())
    assert_healthy(engine, outs, reason=None)
