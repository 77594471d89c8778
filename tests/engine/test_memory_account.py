"""The memory budget's arithmetic (trtllm_backend/memory.py) on plain numbers: how the budget is sized and refused,
what is left for KV, what fits for staging, and an account over its budget refused. Model-free."""

import pytest

from trtllm_backend.memory import MemoryAccount, blocks_freed, resolve_budget

BLOCK = 100


def test_the_default_budget_is_the_full_model_plus_the_base_pool():
    assert resolve_budget(1_000, reserve=0, bytes_per_block=BLOCK, base_kv_blocks=8) == 1_800
    # the staging reserve comes out of that pool, not on top of it
    assert resolve_budget(1_000, reserve=300, bytes_per_block=BLOCK, base_kv_blocks=8) == 1_800


def test_a_given_budget_wins_over_the_base_pool():
    assert resolve_budget(1_000, reserve=300, bytes_per_block=BLOCK, base_kv_blocks=8, given=5_000) == 5_000
    assert resolve_budget(1_000, reserve=0, bytes_per_block=BLOCK, base_kv_blocks=8, given=None) == 1_800


def test_a_budget_without_room_for_the_model_the_reserve_and_one_block_is_refused_naming_the_parameter():
    least = 1_000 + 300 + BLOCK
    assert resolve_budget(1_000, reserve=300, bytes_per_block=BLOCK, base_kv_blocks=0, given=least) == least
    with pytest.raises(
        ValueError, match=r"memory_budget_bytes: 1399 .*staging reserve of policy balanced.*1400 bytes at least"
    ):
        resolve_budget(
            1_000, reserve=300, bytes_per_block=BLOCK, base_kv_blocks=0, given=least - 1, policy_name="balanced"
        )
    with pytest.raises(ValueError, match=r"max_tokens_in_paged_kv_cache: 3 blocks \(1300 bytes with the model\)"):
        resolve_budget(1_000, reserve=300, bytes_per_block=BLOCK, base_kv_blocks=3)
    with pytest.raises(ValueError) as err:  # a static policy has no reserve, and the message says none
        resolve_budget(1_000, reserve=0, bytes_per_block=BLOCK, base_kv_blocks=0)
    assert "reserve" not in str(err.value) and "1100 bytes at least" in str(err.value)


def test_blocks_freed_counts_whole_blocks_and_never_negative():
    assert blocks_freed(1_000, 250, BLOCK) == 7
    assert blocks_freed(1_000, 1_000, BLOCK) == 0
    assert blocks_freed(100, 400, BLOCK) == 0


def test_available_leaves_the_reserve_and_fits_may_use_it():
    a = MemoryAccount(budget=2_000, reserve=300)
    a.update(shared=200, layers=1_000, kv=400, staged=0)
    assert a.used == 1_600
    assert a.available == 100  # for KV: the reserve is kept
    assert a.fits(400) and not a.fits(401)  # for staging: the reserve may be spent


def test_update_records_the_parts_and_refuses_an_account_over_its_budget():
    a = MemoryAccount(budget=1_000, reserve=0)
    a.update(shared=100, layers=500, kv=300, staged=100)
    assert (a.shared, a.layers, a.kv, a.staged, a.used) == (100, 500, 300, 100, 1_000)
    with pytest.raises(AssertionError, match="1001 exceeds the budget 1000"):
        a.update(shared=100, layers=500, kv=300, staged=101)


def test_an_account_before_its_budget_is_resolved_checks_nothing():
    a = MemoryAccount(budget=0, reserve=0)
    a.update(shared=10**9, layers=10**9, kv=0, staged=0)  # the load counts the model first, then sizes the budget
    assert a.used == 2 * 10**9
