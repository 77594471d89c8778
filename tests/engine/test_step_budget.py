"""trtllm_backend.step_budget: the token budget of a step that carries decodes, from measured step times."""

import pytest

from trtllm_backend.step_budget import MIN_PREFILL_CHUNK, StepBudget


def test_full_chunks_without_decodes_or_before_anything_was_measured():
    b = StepBudget(max_num_tokens=256, target_s=0.175)
    assert b.tokens(decode_rows=4) == 256  # nothing measured yet
    b.observe(tokens=200, decode_rows=0, seconds=1.0)
    assert b.tokens(decode_rows=0) == 256  # nothing decoding: nothing to stall
    assert b.tokens(decode_rows=4) < 256


def test_the_budget_is_what_fits_in_the_target_by_the_measured_costs():
    b = StepBudget(max_num_tokens=256, target_s=0.175)
    b.observe(tokens=200, decode_rows=0, seconds=1.0)  # 5 ms a token
    b.observe(tokens=4, decode_rows=4, seconds=0.06)  # a decode step: 40 ms fixed beside its 4 tokens
    assert b.per_token_s == pytest.approx(0.005) and b.fixed_s == pytest.approx(0.04)
    assert b.tokens(decode_rows=4) in (26, 27)  # (0.175 - 0.04) / 0.005, floored


def test_the_budget_is_bounded_by_a_minimum_chunk_and_max_num_tokens():
    slow = StepBudget(max_num_tokens=256, target_s=0.1)
    slow.observe(tokens=100, decode_rows=0, seconds=5.0)  # 50 ms a token: not even two fit
    assert slow.tokens(decode_rows=6) == 6 + MIN_PREFILL_CHUNK
    fast = StepBudget(max_num_tokens=256, target_s=0.1)
    fast.observe(tokens=100, decode_rows=0, seconds=0.01)
    assert fast.tokens(decode_rows=6) == 256


def test_a_zero_target_never_cuts():
    b = StepBudget(max_num_tokens=256, target_s=0.0)
    b.observe(tokens=200, decode_rows=0, seconds=10.0)
    assert b.tokens(decode_rows=8) == 256
    with pytest.raises(ValueError, match="step time target must be >= 0"):
        StepBudget(max_num_tokens=256, target_s=-1.0)


def test_the_costs_follow_a_change_of_speed():
    b = StepBudget(max_num_tokens=512, target_s=0.2)
    for _ in range(3):
        b.observe(tokens=100, decode_rows=0, seconds=1.0)
    slow = b.tokens(decode_rows=1)
    for _ in range(30):  # e.g. layers swapped to a faster precision
        b.observe(tokens=100, decode_rows=0, seconds=0.25)
    assert b.per_token_s == pytest.approx(0.0025, rel=0.01)
    assert b.tokens(decode_rows=1) > 3 * slow


def test_steps_too_small_to_say_anything_are_ignored():
    b = StepBudget(max_num_tokens=256, target_s=0.2)
    b.observe(tokens=10, decode_rows=4, seconds=0.5)  # 6 prefill tokens: mostly fixed cost
    b.observe(tokens=0, decode_rows=0, seconds=0.5)
    assert b.per_token_s is None and b.fixed_s is None
