"""Equal memory on the real model: every policy given one configuration holds the same budget, a static policy
turns all of it beyond its weights into KV, a dynamic one keeps at most one INT4 layer aside to stage swaps, the
INT8 head is bound at load for any policy, and a budget too small is refused naming the parameter.

Needs the INT4 fragments and the INT8 head table that `make setup` builds."""

import pytest
from tests.engine_fixtures import PROMPTS, fragment_dir, make_engine

from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import Manifest
from trtllm_backend.precision import Precision
from trtllm_backend.sampling import SamplingParams

pytestmark = pytest.mark.needs_model

POOL = 2048  # tokens of KV beside the full-precision model (47 MB at fp16): the budget of every engine below


def engine(policy: str, **overrides):
    overrides.setdefault("max_tokens_in_paged_kv_cache", POOL)
    return make_engine(morph_policy=policy, weight_dtype="float16", kv_cache_dtype="float16", **overrides)


@pytest.fixture(scope="module")
def engines():
    return {
        "full": engine("full"),
        "full+int8 head": engine("full", lm_head_precision="int8"),
        "int4:10": engine("int4:10"),
        "balanced": engine("balanced"),
        "balanced, head dynamic": engine("balanced", lm_head_precision="dynamic"),
    }


def left_over(e) -> int:
    a = e.morph.account
    return a.budget - a.reserve - a.used


def test_every_policy_holds_the_same_budget(engines):
    full = engines["full"]
    budget = full.morph.account.budget
    assert budget == full.model.weights_nbytes + POOL // full.config.block_size * full.pool.bytes_per_block
    assert {name: e.morph.account.budget for name, e in engines.items()} == dict.fromkeys(engines, budget)
    for name, e in engines.items():
        assert 0 <= left_over(e) < e.pool.bytes_per_block, name  # everything but a block's remainder is used
        assert not e.check_invariants(), name


def test_a_static_policy_keeps_no_reserve_and_turns_freed_weights_into_kv(engines):
    full, head8, int4 = engines["full"], engines["full+int8 head"], engines["int4:10"]
    assert full.morph.reserve == head8.morph.reserve == int4.morph.reserve == 0
    assert full.pool.num_blocks * full.config.block_size == POOL
    bpb = full.pool.bytes_per_block
    freed_head = full.model.head.nbytes - head8.model.head.nbytes
    assert head8.model.head.precision == Precision.INT8 and freed_head > 0
    assert head8.pool.num_blocks == (full.morph.account.budget - head8.morph.account.used + head8.pool.nbytes) // bpb
    assert (
        head8.pool.num_blocks - full.pool.num_blocks == freed_head // bpb
        or head8.pool.num_blocks - full.pool.num_blocks == freed_head // bpb + 1
    )  # the remainders of two divisions
    assert int4.num_quantized_layers() == 10 and int4.pool.num_blocks > head8.pool.num_blocks


def test_a_dynamic_policy_keeps_at_most_one_int4_layer_aside(engines):
    m = Manifest(fragment_dir())
    int4 = max(m.fragment(i, Precision.INT4)["bytes"] for i in range(m.num_layers))
    full, bal, dyn = engines["full"], engines["balanced"], engines["balanced, head dynamic"]
    assert bal.morph.reserve == int4 and not bal.morph.head_unit
    assert (
        bal.pool.num_blocks
        == (bal.morph.account.budget - bal.morph.account.used + bal.pool.nbytes - int4) // bal.pool.bytes_per_block
    )
    assert full.pool.num_blocks - bal.pool.num_blocks <= int4 // full.pool.bytes_per_block + 1
    # the head as a morph unit needs room to stage its INT8 table: the old cost, now paid out of the same budget
    assert dyn.morph.head_unit and dyn.morph.reserve == m.head_fragment(Precision.INT8)["bytes"] > 10 * int4
    assert dyn.pool.num_blocks < bal.pool.num_blocks


def test_the_budget_holds_through_swaps_and_restores(layer_set):
    e = engine("full", force_morph="down:3@2,up:3@12", fragment_dir=str(layer_set))
    assert e.morph.reserve > 0  # forced swaps stage like a dynamic policy's
    seen = []
    for i, p in enumerate(PROMPTS[:3]):
        e.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True), lambda o: None, request_id=f"p{i}")
    while True:  # run_until_idle and settle_morph in one loop, looking at the account after every step
        e.step()
        a = e.morph.account
        seen.append((a.used, a.budget, e.num_quantized_layers()))
        if not (e.scheduler.has_work() or e.morph.busy(e.counters.iterations)):
            break
        e.morph.wait(0.05)
    assert max(q for *_, q in seen) == 3 and seen[-1][2] == 0
    assert all(used <= budget for used, budget, _ in seen)
    assert not e.check_invariants()


def test_a_budget_too_small_is_refused_naming_the_parameter():
    full = engine("full", max_tokens_in_paged_kv_cache=16)
    weights = full.model.weights_nbytes
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        engine("full", memory_budget_bytes=weights)  # not one KV block
    # 16 tokens of KV cannot also hold a dynamic policy's staging reserve
    with pytest.raises(ValueError, match="max_tokens_in_paged_kv_cache.*staging reserve"):
        engine("balanced", max_tokens_in_paged_kv_cache=16)
    assert engine("full", memory_budget_bytes=weights + full.pool.bytes_per_block).pool.num_blocks == 1


def test_an_int8_head_needs_its_table(tmp_path):
    from tests.engine_fixtures import layers_only_copy

    with pytest.raises(FragmentError, match="lm_head_precision=int8"):
        engine("full", lm_head_precision="int8", fragment_dir=str(layers_only_copy(tmp_path / "layers")))


def test_requests_are_sized_against_the_pool_a_policy_keeps(engines):
    from trtllm_backend.errors import InvalidRequest

    bal = engines["balanced"]
    base = bal.pool.segments[0].num_blocks * bal.config.block_size
    assert base < POOL  # the staging reserve came out of the pool
    with pytest.raises(InvalidRequest, match="KV cache"):
        bal.add_request("hello", SamplingParams(max_tokens=base), lambda o: None)
