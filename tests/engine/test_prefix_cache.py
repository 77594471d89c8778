"""Automatic prefix caching (trtllm_backend/prefix_cache.py) through the pool and the scheduler that use it: reuse of
the longest cached prefix by reference, LRU eviction of blocks nobody holds, identity kept across a segment's
evacuation, no reuse across weights; and on the real model, greedy outputs with reuse equal those without."""

import pytest
from tests.engine.test_kv_cache import pool
from tests.engine.test_scheduler import advance

from trtllm_backend.invariants import block_violations
from trtllm_backend.outputs import RequestTimings
from trtllm_backend.request import Request
from trtllm_backend.sampling import SamplingParams
from trtllm_backend.scheduler import Scheduler

BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), RequestTimings(arrival=0.0))


def run_prefill(s: Scheduler, r: Request) -> None:
    """Admit `r` and compute its whole prompt (as the engine does: computed tokens cached, one token sampled)."""
    s.add(r)
    while r.num_computed < len(r.prompt_ids):
        out = s.schedule()
        advance(out)
        for q, _ in out.scheduled:
            s.pool.cache.cache_computed(q)


def tables(s: Scheduler) -> list[list[int]]:
    return [r.block_table for r in s.running]


def test_a_shared_prefix_is_reused_by_reference_and_not_prefilled():
    s = Scheduler(pool(blocks=16, bs=BS), max_batch_size=8, max_num_tokens=64)
    a = req("a", range(10))  # blocks [0-3] [4-7] full, [8, 9] partial
    run_prefill(s, a)
    b = req("b", list(range(8)) + [50, 51, 52])
    s.add(b)
    out = s.schedule()
    assert (b, 3) in out.scheduled  # only the tokens after the two cached blocks are computed
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert s.pool.cache.refs[a.block_table[0]] == 2
    assert (b.reused_blocks, b.missed_blocks, b.reused_tokens, b.kv_reuse().hit_rate) == (2, 0, 8, 1.0)
    stats = s.pool.cache.stats
    assert (stats.hit_blocks, stats.miss_blocks, stats.reused_tokens) == (2, 2, 8)  # a missed 2, b hit 2
    assert block_violations(s.pool, tables(s)) == []


def test_the_last_prompt_token_is_always_computed():
    s = Scheduler(pool(blocks=16, bs=BS), max_batch_size=8, max_num_tokens=64)
    a = req("a", range(8))
    run_prefill(s, a)
    cached = a.block_table[:2]
    s.finish(a)
    b = req("b", range(8))  # the same prompt, two full cached blocks
    s.add(b)
    out = s.schedule()
    assert (b, 4) in out.scheduled and b.reused_blocks == 1  # the second block holds the last token: computed
    assert b.block_table[0] == cached[0] and b.block_table[1] != cached[1]  # a cached block is never written
    assert cached[1] in s.pool.cache.evictable


def test_unreferenced_cached_blocks_stay_until_needed_then_go_least_recently_used_first():
    p = pool(blocks=6, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    a = req("a", range(9))  # 2 full blocks + 1 partial
    run_prefill(s, a)
    first, second = a.block_table[:2]
    s.finish(a)
    assert p.num_evictable == 2 and p.num_free == 4 and p.num_used == 0  # the partial block went back
    assert p.num_allocatable == 6
    got = p.allocate(5)  # 4 free + the coldest cached block: the tail of a's prefix, not its head
    assert second in got and first not in got and p.num_evictable == 1
    assert p.cache.stats.evictions == 1
    p.free(got)
    b = req("b", list(range(4)) + [70, 71])
    s.add(b)
    s.schedule()
    assert b.block_table[0] == first and b.reused_blocks == 1
    assert block_violations(p, tables(s)) == []


def test_misses_of_evicted_blocks_are_counted_as_what_a_bigger_pool_would_serve():
    p = pool(blocks=6, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    a = req("a", range(9))  # two full blocks cached once it finishes
    run_prefill(s, a)
    s.finish(a)
    p.free(p.allocate(5))  # evicts the coldest cached block: the second
    b = req("b", list(range(8)) + [70, 71])
    run_prefill(s, b)
    stats = p.cache.stats
    assert (b.reused_blocks, b.missed_blocks) == (1, 1)
    assert stats.evicted_miss_blocks == 1  # the second block had been cached: a bigger pool would have served it
    s.finish(b)  # b recomputed the second block: cached again, no longer counted as evicted
    assert len(p.cache.evicted) == 0
    p.free(p.allocate(6))  # evicts every cached block, the whole chain
    c = req("c", list(range(8)) + [80, 81, 82, 83, 84])
    run_prefill(s, c)
    assert stats.evicted_miss_blocks == 1 + 2
    d = req("d", list(range(100, 109)))  # never seen: its misses are not the pool's size
    run_prefill(s, d)
    assert stats.evicted_miss_blocks == 3 and stats.miss_blocks == 2 + 1 + 3 + 2
    assert block_violations(p, tables(s)) == []


def test_a_blocked_admission_gives_its_reused_prefix_back():
    p = pool(blocks=4, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    a = req("a", range(9))
    run_prefill(s, a)
    s.finish(a)
    hog = p.allocate(2)  # the two free blocks; the cached ones stay cached
    big = req("big", list(range(8)) + list(range(100, 112)))  # reuses 2 blocks, needs 3 more: only 0 left
    s.add(big)
    out = s.schedule()
    assert out.admission_blocked and big.block_table == [] and big.num_computed == 0
    assert p.num_evictable == 2 and p.cache.refs == dict.fromkeys(hog, 1)
    assert p.cache.stats.lookups == 1  # a blocked try is not counted


def test_no_reuse_across_weights_and_none_when_disabled():
    p = pool(blocks=16, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    run_prefill(s, req("a", range(9)))
    p.cache.set_weights((3, 5))  # two layers swapped to INT4: KV computed at full precision is another prefix
    b = req("b", range(9))
    s.add(b)
    s.schedule()
    assert b.reused_blocks == 0 and b.missed_blocks == 2

    off = pool(blocks=16, bs=BS)
    off.cache.enabled = False
    s2 = Scheduler(off, max_batch_size=8, max_num_tokens=64)
    run_prefill(s2, req("a", range(9)))
    c = req("c", range(9))
    s2.add(c)
    s2.schedule()
    assert c.reused_blocks == 0 and off.num_evictable == 0 and not off.cache.block_of


def test_reuse_across_morphs_keeps_the_cache_through_a_swap():
    p = pool(blocks=16, bs=BS)
    p.cache.across_weights = True  # kv_cache_reuse_across_morphs
    s = Scheduler(p, max_batch_size=8, max_num_tokens=4)  # one block per iteration
    a = req("a", range(9))
    s.add(a)
    advance(s.schedule())
    p.cache.cache_computed(a)
    p.cache.set_weights((3, 5))  # a swap between two chunks: a keeps caching, and its blocks stay findable
    while a.num_computed < len(a.prompt_ids):
        advance(s.schedule())
        p.cache.cache_computed(a)
    assert len(a.block_names) == 2 and p.cache.weights_version == 0
    b = req("b", range(9))
    s.add(b)
    s.schedule()
    assert b.reused_blocks == 2 and b.missed_blocks == 0


def test_a_request_stops_caching_once_the_weights_change_under_it():
    p = pool(blocks=16, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=4)  # one block per iteration
    a = req("a", range(13))
    s.add(a)
    advance(s.schedule())
    p.cache.cache_computed(a)
    assert len(p.cache.block_of) == 1
    p.cache.set_weights((7,))  # a morph between two chunks: the rest of a's KV mixes precisions
    for _ in range(2):
        advance(s.schedule())
        p.cache.cache_computed(a)
    assert len(p.cache.block_of) == 1 and len(a.block_names) == 1


def test_evacuation_moves_a_shared_block_once_and_cached_blocks_keep_their_identity():
    p = pool(blocks=8, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    seg2 = p.add_segment(8)
    hold = p.allocate(8)  # fill the first segment so everything below lands in the second
    a = req("a", range(9))
    b = req("b", list(range(8)) + [40])
    run_prefill(s, a)
    run_prefill(s, b)
    assert all(seg2.owns(x) for x in a.block_table) and b.block_table[:2] == a.block_table[:2]
    c = req("c", list(range(200, 209)))
    run_prefill(s, c)
    s.finish(c)  # c's two full blocks: cached, unreferenced, in the second segment
    p.free(hold)
    assert p.evacuate(seg2, tables(s))
    assert a.block_table[:2] == b.block_table[:2] and not any(seg2.owns(x) for t in tables(s) for x in t)
    assert block_violations(p, tables(s)) == []
    p.release_segment(seg2)
    d = req("d", list(range(200, 208)) + [1])
    s.add(d)
    s.schedule()
    assert d.reused_blocks == 2  # c's prefix survived the move
    assert block_violations(p, tables(s)) == []


def test_a_shrink_drops_the_coldest_cached_blocks_never_a_hot_prefix():
    p = pool(blocks=4, bs=BS)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    seg2 = p.add_segment(4)
    cold = req("cold", list(range(300, 309)))
    run_prefill(s, cold)  # lands in the first segment (2 full blocks + 1 partial)
    s.finish(cold)
    hold = p.allocate(2)  # the rest of the first segment
    hot = req("hot", list(range(9)))
    run_prefill(s, hot)  # in the second segment
    s.finish(hot)  # cached after `cold`: hotter
    assert p.cache.stats.evictions == 0
    assert p.evacuate(seg2, [hold])  # no free room outside: the hot prefix takes the cold one's blocks
    p.release_segment(seg2)
    assert p.cache.stats.evictions == 2 and block_violations(p, [hold]) == []
    p.free(hold)
    again = req("again", list(range(8)) + [9])
    s.add(again)
    s.schedule()
    assert again.reused_blocks == 2
    retry = req("retry", list(range(300, 308)) + [1])
    s.add(retry)
    s.schedule()
    assert retry.reused_blocks == 0  # the cold prefix was the one dropped
    assert block_violations(p, tables(s)) == []


# ---- the real model ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_outputs_with_reuse_equal_those_without():
    """Multi-turn prompts (each the previous turn, its answer and a new message) on one engine with prefix
    caching and one without. The reused blocks' K/V is exactly what those tokens computed under these weights; the
    outputs are compared token for token. NOTE: logits differ in the last bits (~1e-5 here): the engine's prefill
    rows take the skinny kernels up to their row limit and MKL above it, so any chunking (the stall-free cut
    already does it) moves them; a near tie is the only excuse for a different token."""
    from tests.engine_fixtures import PROMPTS, assert_same_up_to_near_tie, make_engine

    turns = [PROMPTS[1], PROMPTS[5], PROMPTS[3]]
    outputs = {}
    for caching in (True, False):
        engine = make_engine(enable_prefix_caching=caching, max_num_tokens=512)
        history, got, gaps = "", [], []
        for t, message in enumerate(turns):
            prompt = history + message
            rows: list[float] = []
            tokens: list[int] = []
            engine.on_logits = lambda rid, row: rows.append(float(row.topk(2).values.diff().abs()))
            engine.add_request(
                prompt, SamplingParams(max_tokens=24, ignore_eos=True), lambda o: tokens.extend(o.token_ids)
            )
            engine.run_until_idle()
            got.append(tokens)
            gaps.append(rows)
            history = prompt + engine.tokenizer.decode(tokens) + " "
        stats = engine.pool.cache.stats
        outputs[caching] = (got, gaps, stats.reused_tokens, engine.counters.prompt_tokens)
        assert engine.counters.invariant_violations == 0
    (on, _, reused, prefilled_on), (off, _, _, prefilled_off) = outputs[True], outputs[False]
    assert reused > 0 and prefilled_on == prefilled_off - reused  # reused tokens are never prefilled
    for a, gaps, b in zip(off, outputs[False][1], on):
        assert_same_up_to_near_tie(a, gaps, b)


@pytest.mark.slow
def test_cached_blocks_nobody_holds_are_free_room_not_kv_pressure():
    """Morphing that knows the cache: a pool full of cached blocks nobody holds admits a request that needs them by
    evicting (least recently used first), and the controller sees no KV pressure meanwhile: no swap down."""
    from tests.engine_fixtures import PROMPTS, make_engine

    engine = make_engine(morph_policy="balanced", max_tokens_in_paged_kv_cache=1024, tpot_slo_s=0.0)
    pool = engine.pool
    seen = []
    on_iteration = engine.morph.on_iteration
    engine.morph.on_iteration = lambda signals, *a: (seen.append(signals), on_iteration(signals, *a))[1]
    i = 0
    while pool.num_evictable < pool.num_blocks // 2:  # distinct prompts, cached after they finish
        engine.add_request(f"Letter {i}. " + PROMPTS[5] * 2, SamplingParams(max_tokens=4), lambda o: None)
        engine.run_until_idle()
        i += 1
    tokens = (pool.num_free + 4) * pool.block_size  # more than the free lists hold: needs evictions
    prompt = engine.tokenizer.decode(list(range(1000, 1000 + tokens)))
    seen.clear()
    engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), lambda o: None)
    engine.run_until_idle()
    assert pool.cache.stats.evictions > 0
    assert seen and all(not s.admission_blocked and s.queue_blocks_short == 0 and s.kv_usage < 0.9 for s in seen)
    assert engine.counters.swaps_down == 0 and engine.counters.invariant_violations == 0


@pytest.mark.slow
def test_a_restore_keeps_the_cached_prefixes_it_moves_and_counts_idle_blocks_as_free():
    """A forced swap down adds a segment; a prompt cached there survives the restore's drain (moved, same names),
    and once the same unit is swapped down again (the same weights) it is reused, with the same tokens."""
    from trtllm_backend.controller import Action

    from tests.engine_fixtures import PROMPTS, make_engine

    # (the checks run by hand: the blocks this test holds outside any request would count as violations)
    engine = make_engine(block_size=8, max_tokens_in_paged_kv_cache=144, force_morph="down:1@0", check_invariants=False)
    pool, force = engine.pool, engine.morph.controller.forced

    def forced(kind):
        force[engine.counters.iterations] = Action(kind, 1, "test", forced=True)
        assert engine.settle_morph(timeout_s=120)

    def generate(prompt):
        out: list[int] = []
        engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), lambda o: out.extend(o.token_ids))
        engine.run_until_idle()
        return out

    assert engine.settle_morph(timeout_s=120) and len(pool.segments) == 2
    added = pool.segments[1]
    hold = pool.allocate(len(pool.segments[0].free))  # the prompt lands in the added segment
    first = generate(PROMPTS[5])
    cached = [b for b in pool.cache.evictable if added.owns(b)]
    assert cached
    assert engine.morph.usage_after_shrink() == pool.num_used / pool.segments[0].num_blocks  # idle blocks: free
    promised = engine.morph.usage_after_shrink(reserved_blocks=2)  # guaranteed_no_evict's promises: as good as used
    assert promised == (pool.num_used + 2) / pool.segments[0].num_blocks
    pool.free(hold)
    names = set(pool.cache.block_of)
    forced("up")
    assert len(pool.segments) == 1 and set(pool.cache.block_of) == names and pool.cache.stats.evictions == 0
    forced("down")  # the same unit again: the prompt's blocks are the same prefix
    prompt_blocks = (len(engine.tokenizer.encode(PROMPTS[5])) - 1) // 8  # all but the one of the last token
    assert generate(PROMPTS[5]) == first and pool.cache.stats.hit_blocks == prompt_blocks
    assert engine.check_invariants() == []


@pytest.mark.slow
@pytest.mark.parametrize("cache_pressure", [False, True])
def test_a_returning_prefix_the_pool_evicted_swaps_down_only_when_the_cache_pressure_is_on(caplog, cache_pressure):
    """morph_down_cache_miss_s: a conversation whose blocks the pool evicted comes back, its prefill on them is timed
    at the measured cost of a token, and (with the pressure on) the controller swaps down to grow the pool."""
    import logging

    from tests.engine_fixtures import PROMPTS, make_engine

    overrides = {"down_cache_miss_s": 1e-6} if cache_pressure else {}
    engine = make_engine(
        morph_policy="balanced", max_tokens_in_paged_kv_cache=256, tpot_slo_s=0.0, morph_overrides=overrides
    )
    seen = []
    on_iteration = engine.morph.on_iteration
    engine.morph.on_iteration = lambda load, *a: (seen.append(load), on_iteration(load, *a))[1]

    def serve(prompt: str) -> None:
        engine.add_request(prompt, SamplingParams(max_tokens=2), lambda o: None)
        engine.run_until_idle()

    conversation = PROMPTS[5] + " " + PROMPTS[1]
    serve(conversation)
    for i in range(4):  # other prompts, one at a time (no queue, no KV shortage), push its blocks out
        serve(f"{i}. " + PROMPTS[1] + " " + PROMPTS[5])
    stats = engine.pool.cache.stats
    assert stats.evicted_miss_blocks == 0 and stats.evictions > 0 and engine.counters.swaps_down == 0
    with caplog.at_level(logging.INFO, logger="morphserve.morph"):
        serve(conversation)
        engine.settle_morph()
    looked = (len(engine.tokenizer.encode(conversation)) - 1) // engine.pool.block_size
    assert looked >= 3 and stats.evicted_miss_blocks == looked  # every block of it had been cached, then evicted
    assert any(load.evicted_miss_s > 0 for load in seen)  # timed at the engine's measured cost of a token
    swapped = [r.message for r in caplog.records if "prefix cache had evicted" in r.message]
    assert bool(swapped) == cache_pressure
    assert (engine.counters.swaps_down > 0) == cache_pressure
