"""trtllm_backend.invariants on the real engine: a healthy engine (full, INT4, mid-morph) has no violation;
each kind of broken state is found, counted once per iteration and logged with the state."""

import logging

import pytest
from tests.engine_fixtures import PROMPTS, make_engine

from trtllm_backend.precision import Precision
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.needs_model


def _add(engine, n=4, max_tokens=8):
    for i, p in enumerate(PROMPTS[:n]):
        engine.add_request(
            p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), lambda o: None, request_id=f"p{i}"
        )


def test_a_healthy_engine_has_no_violation_through_swaps_and_restores():
    engine = make_engine(force_morph="down:2@1,up:1@5")
    assert engine.config.check_invariants  # on by default
    _add(engine, 8, 16)
    engine.run_until_idle()
    assert engine.settle_morph(timeout_s=120)
    assert engine.counters.swaps_down == 2 and engine.counters.swaps_up == 1
    assert engine.counters.invariant_violations == 0 and engine.check_invariants() == []


def test_broken_states_are_found():
    engine = make_engine()
    _add(engine, 2, 40)
    for _ in range(3):
        engine.step()
    a, b = engine.scheduler.running[:2]
    assert engine.check_invariants() == []

    b.block_table.append(a.block_table[0])  # one block in two tables, with one reference
    found = engine.check_invariants()
    assert any("block " + str(a.block_table[0]) + " in 2 tables, 1 references" in line for line in found), found
    b.block_table.pop()

    engine.pool.cache.refs[a.block_table[0]] += 1  # a reference no table holds
    assert any("reference counts differ" in line for line in engine.check_invariants())
    engine.pool.cache.refs[a.block_table[0]] -= 1

    seg = engine.pool.segments[0]
    seg.free.append(a.block_table[0])  # held and free at once
    assert any("both held and free" in line for line in engine.check_invariants())
    seg.free.pop()

    lost = seg.free.pop()  # a block nobody holds nor lists as free
    assert any("held +" in line and "!= " in line for line in engine.check_invariants())
    seg.free.append(lost)

    account = engine.morph.account
    account.budget, budget = account.used - 1, account.budget
    assert any("exceed the budget" in line for line in engine.check_invariants())
    account.budget = budget

    slot = engine.model.slots[3]
    slot.precision = Precision.INT4  # a slot claiming INT4 that the morph manager never swapped
    found = engine.check_invariants()
    assert any("INT4 layers [3]" in line for line in found), found
    slot.precision = Precision.FULL
    assert engine.check_invariants() == []


def test_kv_memory_the_account_never_saw_is_found_across_iterations():
    # The morph manager refreshes its account where it changes bindings or segments, not every iteration, so
    # a segment added behind its back stays visible to the memory invariant instead of being copied in.
    engine = make_engine()
    _add(engine, 1, 30)
    engine.step()
    assert engine.counters.invariant_violations == 0
    engine.pool.add_segment(4)
    engine.step()
    engine.step()
    assert engine.counters.invariant_violations >= 2
    assert any("the account says layers" in line for line in engine.check_invariants())


def test_a_violation_is_counted_each_iteration_and_logged_once(caplog):
    engine = make_engine()
    _add(engine, 2, 30)
    engine.step()
    a, b = engine.scheduler.running[:2]
    b.block_table.append(a.block_table[0])
    with caplog.at_level(logging.ERROR, logger="morphserve.engine"):
        for _ in range(3):
            engine.step()
    assert engine.counters.invariant_violations >= 3
    logged = [r.getMessage() for r in caplog.records if "invariant violated" in r.getMessage()]
    assert len(logged) == 1 and "reference counts differ" in logged[0]
