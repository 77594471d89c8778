"""Continuous batching and preemption give the tokens of lone greedy runs (near-tie rule)."""

import pytest
from tests.engine_fixtures import PROMPTS, assert_same_up_to_near_tie, make_engine, run_greedy

pytestmark = pytest.mark.needs_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def lone():
    """Each prompt decoded alone."""
    engine = make_engine()
    tokens, gaps = {}, {}
    for i, p in enumerate(PROMPTS):
        t, g = run_greedy(engine, [p], MAX_TOKENS)
        tokens[f"p{i}"], gaps[f"p{i}"] = t["p0"], g["p0"]
    return tokens, gaps


def test_batched_paged_decode_matches_lone_runs(lone):
    engine = make_engine(max_num_tokens=64)  # prefills are chunked and mixed with decodes
    batched, _ = run_greedy(engine, PROMPTS, MAX_TOKENS)
    for rid, toks in batched.items():
        assert_same_up_to_near_tie(lone[0][rid], lone[1][rid], toks)
    assert engine.pool.num_used == 0


def test_tiny_pool_forces_preemption_and_finishes_every_request(lone):
    # 8 blocks of 8 tokens: the longest prompt plus its output fits alone; all eight together cannot.
    engine = make_engine(block_size=8, max_tokens_in_paged_kv_cache=64 + 8 * 2)
    batched, _ = run_greedy(engine, PROMPTS, MAX_TOKENS)
    assert engine.scheduler.num_preemptions > 0
    for rid, toks in batched.items():
        assert_same_up_to_near_tie(lone[0][rid], lone[1][rid], toks)
    assert engine.pool.num_used == 0


def test_guaranteed_no_evict_never_preempts_in_the_same_tiny_pool(lone):
    engine = make_engine(
        block_size=8, max_tokens_in_paged_kv_cache=64 + 8 * 2, batch_scheduler_policy="guaranteed_no_evict"
    )
    batched, _ = run_greedy(engine, PROMPTS, MAX_TOKENS)
    assert engine.scheduler.num_preemptions == 0 and len(batched) == len(PROMPTS)
    for rid, toks in batched.items():
        assert_same_up_to_near_tie(lone[0][rid], lone[1][rid], toks)
    assert engine.pool.num_used == 0 and engine.scheduler.reserved_blocks() == 0


def test_prefill_cut_to_the_step_budget_beside_decodes_matches_lone_runs(lone):
    engine = make_engine(max_num_tokens=256, prefill_chunk_tpot_share=0.5)
    budget = engine.step_budget
    budget.per_token_s, budget.fixed_s = budget.target_s / 24, 0.0  # 24 tokens fit in a step
    budget.observe = lambda *a: None  # keep that cost: this test is about the cut, not the measurement
    steps = []
    schedule = engine.scheduler.schedule

    def recording(token_budget=None):
        out = schedule(token_budget)
        steps.append((engine.scheduler.decode_rows(), [n for _, n in out.scheduled]))
        return out

    engine.scheduler.schedule = recording
    batched, _ = run_greedy(engine, PROMPTS, MAX_TOKENS)
    for rid, toks in batched.items():
        assert_same_up_to_near_tie(lone[0][rid], lone[1][rid], toks)
    with_decodes = [sum(ns) for rows, ns in steps if any(n == 1 for n in ns)]
    assert with_decodes and max(with_decodes) <= 24
    assert steps[0][1] and sum(steps[0][1]) > 24  # the first step decodes nothing: it prefills in full
