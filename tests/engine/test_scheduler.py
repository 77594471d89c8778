import pytest
from tests.engine.test_kv_cache import pool

from trtllm_backend.errors import InvalidRequest

from trtllm_backend.outputs import RequestTimings
from trtllm_backend.request import Request, Status
from trtllm_backend.sampling import SamplingParams
from trtllm_backend.scheduler import Scheduler


def req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=50), RequestTimings(arrival=0.0))


def advance(sched_out):
    """What the engine does after a forward: computed tokens move on, finished prefills sample one token."""
    for r, n in sched_out.scheduled:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.token_ids.append(0)


def test_requests_join_and_leave_every_iteration():
    s = Scheduler(pool(blocks=11, bs=4), max_batch_size=8, max_num_tokens=64)
    a = req("a", 5)
    s.add(a)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5)]
    advance(out)
    b = req("b", 3)
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 3)]  # decode and prefill together
    advance(out)
    s.finish(a)
    assert a.status == Status.FINISHED and a.block_table == []
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 1)]


def test_chunked_prefill_respects_token_budget():
    s = Scheduler(pool(blocks=11, bs=4), max_batch_size=8, max_num_tokens=8)
    a = req("a", 20)
    s.add(a)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(out.scheduled[0][1])
        advance(out)
    assert chunks == [8, 8, 4]
    assert len(a.block_table) == 5


def test_a_step_budget_cuts_the_prefill_chunk_beside_decodes():
    s = Scheduler(pool(blocks=20, bs=4), max_batch_size=8, max_num_tokens=64)
    a = req("a", 3)
    s.add(a)
    advance(s.schedule())
    assert s.decode_rows() == 1
    s.add(req("b", 40))
    out = s.schedule(token_budget=9)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 8)]
    advance(out)
    assert s.decode_rows() == 1  # b is mid-prefill, not decoding
    out = s.schedule(token_budget=1000)  # never above max_num_tokens
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 32)]


def test_admission_waits_for_blocks():
    p = pool(blocks=4, bs=4)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    s.add(req("a", 12))  # 3 blocks
    s.add(req("b", 8))  # 2 blocks: does not fit
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a"] and out.admission_blocked
    assert [r.request_id for r in s.waiting] == ["b"]


def test_decode_without_blocks_preempts_newest_and_requeues_it_first():
    p = pool(blocks=4, bs=4)
    s = Scheduler(p, max_batch_size=8, max_num_tokens=64)
    a, b = req("a", 8), req("b", 8)  # 2 blocks each: pool full after prefill
    s.add(a)
    s.add(b)
    advance(s.schedule())
    assert p.num_free == 0
    out = s.schedule()  # a's 9th token needs a third block: b (newest) is preempted
    assert out.preempted == [b] and [r.request_id for r, _ in out.scheduled] == ["a"]
    assert b.status == Status.WAITING and b.num_computed == 0 and b.block_table == [] and s.waiting[0] is b
    assert s.num_preemptions == 1 and b.preemptions == 1
    assert b.num_tokens == 9  # its sampled token is kept and recomputed with the prompt


def test_max_batch_size_caps_running():
    s = Scheduler(pool(blocks=11, bs=4), max_batch_size=2, max_num_tokens=64)
    for i in range(3):
        s.add(req(f"r{i}", 2))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


# ---- priorities (lower is more important) ------------------------------------------------------------------


def preq(rid: str, n_prompt: int, priority: int, arrival: float = 0.0, max_tokens: int = 50) -> Request:
    return Request(
        rid,
        list(range(100 * len(rid), 100 * len(rid) + n_prompt)),
        SamplingParams(max_tokens=max_tokens, priority=priority),
        RequestTimings(arrival=arrival),
    )


def test_the_most_important_waiting_request_is_admitted_first():
    s = Scheduler(pool(blocks=11, bs=4), max_batch_size=1, max_num_tokens=64)
    s.add(preq("batch", 3, priority=5, arrival=0.0))
    s.add(preq("chat", 3, priority=0, arrival=1.0))
    s.add(preq("batch2", 3, priority=5, arrival=0.5))
    assert [r.request_id for r in s.waiting] == ["chat", "batch", "batch2"]
    assert s.waiting_within(0) == 1 and s.waiting_by_priority() == ((0, 1), (5, 2))
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["chat"]


def test_an_important_request_preempts_less_important_running_work_for_room():
    s = Scheduler(pool(blocks=4, bs=4), max_batch_size=8, max_num_tokens=64)
    batch = preq("batch", 12, priority=5)  # 3 of the 4 blocks
    s.add(batch)
    advance(s.schedule())
    chat = preq("chat", 6, priority=0, arrival=1.0)  # needs 2 blocks: only 1 free
    s.add(chat)
    out = s.schedule()
    assert out.preempted == [batch] and (chat, 6) in out.scheduled
    assert all(r is not batch for r, _ in out.scheduled)  # its decode this iteration was given back
    assert s.waiting == [batch] and batch.block_table == [] and s.preemptions_within(0) == 0
    assert s.preemptions_within(5) == 1


def test_a_request_never_preempts_its_own_priority_or_a_more_important_one():
    s = Scheduler(pool(blocks=4, bs=4), max_batch_size=1, max_num_tokens=64)
    chat = preq("chat", 3, priority=0)
    s.add(chat)
    advance(s.schedule())
    s.add(preq("peer", 3, priority=0, arrival=1.0))
    s.add(preq("batch", 3, priority=3, arrival=2.0))
    out = s.schedule()  # the batch is full (max_batch_size=1): both wait
    assert out.preempted == [] and [r.request_id for r, _ in out.scheduled] == ["chat"]
    assert not out.admission_blocked  # a full batch is not a KV shortage


def test_a_less_important_prefill_yields_its_chunk_to_a_more_important_arrival():
    s = Scheduler(pool(blocks=64, bs=4), max_batch_size=8, max_num_tokens=16)
    batch = preq("batch", 100, priority=5)  # a long prompt: 16 tokens a step for 7 steps
    s.add(batch)
    advance(s.schedule())
    chat = preq("chat", 10, priority=0, arrival=1.0)
    s.add(chat)
    out = s.schedule()
    assert out.scheduled == [(chat, 10), (batch, 6)]  # the chat's whole prompt first, the batch gets what is left
    advance(out)
    assert s.schedule().scheduled == [(chat, 1), (batch, 15)]  # nobody waits: the usual order again


def test_a_less_important_decode_never_yields():
    s = Scheduler(pool(blocks=64, bs=4), max_batch_size=8, max_num_tokens=8)
    batch = preq("batch", 4, priority=5)
    s.add(batch)
    advance(s.schedule())  # its prompt done: it decodes from now on
    chat = preq("chat", 20, priority=0, arrival=1.0)
    s.add(chat)
    assert s.schedule().scheduled == [(batch, 1), (chat, 7)]


def test_prefills_of_one_priority_keep_their_arrival_order():
    s = Scheduler(pool(blocks=64, bs=4), max_batch_size=8, max_num_tokens=16)
    first = preq("first", 100, priority=5)
    s.add(first)
    advance(s.schedule())
    s.add(preq("second", 10, priority=5, arrival=1.0))
    assert [(r.request_id, n) for r, n in s.schedule().scheduled] == [("first", 16)]


def test_a_yielded_prefill_preempted_to_admit_a_more_important_request_is_not_scheduled():
    s = Scheduler(pool(blocks=8, bs=4), max_batch_size=8, max_num_tokens=20)
    batch = preq("batch", 30, priority=5)
    s.add(batch)
    advance(s.schedule())  # 20 tokens: 5 blocks held
    chat = preq("chat", 20, priority=0, arrival=1.0)  # 5 blocks: only 3 free
    s.add(chat)
    out = s.schedule()
    assert out.preempted == [batch] and out.scheduled == [(chat, 20)]
    assert batch.status == Status.WAITING and batch.block_table == []


def test_a_decode_short_of_blocks_preempts_the_least_important_running_request():
    s = Scheduler(pool(blocks=4, bs=4), max_batch_size=8, max_num_tokens=64)
    chat, batch = preq("chat", 8, priority=0), preq("batch", 8, priority=2, arrival=-1.0)  # batch arrived first
    s.add(batch)
    s.add(chat)
    advance(s.schedule())
    out = s.schedule()  # chat's 9th token needs a third block: the batch request goes, though older
    assert out.preempted == [batch] and [r.request_id for r, _ in out.scheduled] == ["chat"]


@pytest.mark.parametrize("bad", [11, -11, 1.5, True, "0"])
def test_a_priority_out_of_range_is_named(bad):
    with pytest.raises(InvalidRequest, match=r"priority: must be an integer in \[-10, 10\]"):
        SamplingParams(priority=bad)


def test_queue_blocks_short_counts_what_the_waiting_queue_lacks_within_a_priority():
    s = Scheduler(pool(blocks=4, bs=4), max_batch_size=8, max_num_tokens=64)
    assert s.head_within(0) is None and s.queue_blocks_short(0) == 0  # nobody waits
    hog = req("hog", 12)  # 3 of the 4 blocks
    s.add(hog)
    advance(s.schedule())
    big = Request("big", list(range(10)), SamplingParams(max_tokens=5, priority=2), RequestTimings(arrival=1.0))
    s.add(big)
    out = s.schedule()
    assert out.admission_blocked and s.waiting == [big] and big.block_table == []
    assert s.pool.num_allocatable == 0  # the hog's first decode took the last block
    assert s.head_within(2) is big and s.queue_blocks_short(2) == 3  # 10 tokens: 3 blocks
    assert s.head_within(1) is None and s.queue_blocks_short(1) == 0  # a less important head is no load of class 1
    small = Request("small", list(range(5)), SamplingParams(max_tokens=5, priority=0), RequestTimings(arrival=2.0))
    s.add(small)  # more important: ahead of big
    assert s.waiting == [small, big]
    assert s.queue_blocks_short(0) == 2  # class 0 alone: small's 5 tokens
    assert s.queue_blocks_short(2) == 2 + 3  # the whole queue: what one swap must pay for to admit both
    s.finish(hog)
    assert s.queue_blocks_short(2) == 1  # 4 blocks free now, 5 needed


def test_queue_blocks_short_counts_only_as_many_as_free_batch_slots():
    s = Scheduler(pool(blocks=3, bs=4), max_batch_size=2, max_num_tokens=64)
    a = req("a", 8)
    s.add(a)
    advance(s.schedule())  # a holds 2 of the 3 blocks, one batch slot left
    for rid in ("b", "c", "d"):
        s.add(req(rid, 8))
    s.schedule()  # b cannot be admitted with 1 block free
    assert [r.request_id for r in s.waiting] == ["b", "c", "d"] and len(s.running) == 1
    assert s.pool.num_allocatable == 0  # a's decode took the last block
    assert s.queue_blocks_short(0) == 2  # b alone fits the one free slot: c and d could not run anyway


# ---- capacity policies (TensorRT-LLM's batch_scheduler_policy) -------------------------------------------------


def no_evict(blocks: int, bs: int = 4, **kw) -> Scheduler:
    return Scheduler(
        pool(blocks=blocks, bs=bs), max_batch_size=8, max_num_tokens=64, policy="guaranteed_no_evict", **kw
    )


def mreq(rid: str, n_prompt: int, max_tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return preq(rid, n_prompt, priority, arrival, max_tokens=max_tokens)


def run_to_the_end(s: Scheduler, steps: int) -> list:
    """Schedule `steps` iterations (computed blocks cached, as the engine does); requests that reach prompt +
    max_tokens finish. Returns every preemption."""
    preempted = []
    for _ in range(steps):
        out = s.schedule()
        preempted += out.preempted
        advance(out)
        for r, _ in out.scheduled:
            s.pool.cache.cache_computed(r)
        for r in list(s.running):
            if r.num_tokens - len(r.prompt_ids) >= r.params.max_tokens and r.num_computed == r.num_tokens - 1:
                s.finish(r)
    return preempted


def test_an_unknown_capacity_policy_is_named():
    with pytest.raises(ValueError, match="batch_scheduler_policy must be one of max_utilization, guaranteed_no_evict"):
        Scheduler(pool(blocks=4, bs=4), 8, 64, policy="greedy")


def test_no_evict_admits_only_what_can_run_to_max_tokens_beside_the_running():
    s = no_evict(blocks=6)
    a, b = mreq("a", 8, max_tokens=8), mreq("b", 4, max_tokens=8)  # a may reach 16 tokens: 4 blocks
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a"] and out.admission_blocked  # b needs 3 of the 2 left
    assert len(a.block_table) == 2 and s.reserved_blocks() == 2  # holds its prompt, promised the rest
    assert s.queue_blocks_short(0) == 1
    # max_utilization admits both at once (b's prompt fits) and pays for it with a preemption later
    m = Scheduler(pool(blocks=6, bs=4), 8, 64)
    a2, b2 = mreq("a", 8, max_tokens=8), mreq("b", 4, max_tokens=8)
    m.add(a2)
    m.add(b2)
    assert len(m.schedule().scheduled) == 2 and m.reserved_blocks() == 0


def test_no_evict_never_preempts_where_max_utilization_thrashes():
    def workload(s: Scheduler) -> list[Request]:
        reqs = [mreq(f"r{i}", 6, max_tokens=14, arrival=float(i)) for i in range(5)]  # 20 tokens: 5 blocks each
        for r in reqs:
            s.add(r)
        return reqs

    greedy = Scheduler(pool(blocks=12, bs=4), 8, 64)
    reqs = workload(greedy)
    assert run_to_the_end(greedy, 200) and all(r.status == Status.FINISHED for r in reqs)
    careful = no_evict(blocks=12)
    reqs = workload(careful)
    assert run_to_the_end(careful, 200) == [] and all(r.status == Status.FINISHED for r in reqs)
    assert careful.num_preemptions == 0


def test_no_evict_counts_a_reused_prefix_as_held():
    s = no_evict(blocks=5)
    first = mreq("first", 8, max_tokens=4)  # 12 tokens: 3 blocks
    s.add(first)
    run_to_the_end(s, 20)
    assert first.status == Status.FINISHED and s.pool.num_evictable >= 2  # its prompt blocks stay cached
    again = mreq("first", 9, max_tokens=11)  # the same 8 tokens and one more, 20 tokens: 5 blocks, 2 of them cached
    s.add(again)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["first"] and again.reused_blocks == 2
    assert s.reserved_blocks() == 5 - len(again.block_table)


def test_a_more_important_request_still_preempts_under_no_evict():
    s = no_evict(blocks=6)
    batch = mreq("batch", 8, max_tokens=12, priority=2)  # 5 blocks promised
    s.add(batch)
    advance(s.schedule())
    chat = mreq("chat", 4, max_tokens=4, priority=0, arrival=1.0)  # 2 blocks: only 1 left unpromised
    s.add(chat)
    out = s.schedule()
    assert out.preempted == [batch] and [r.request_id for r, _ in out.scheduled] == ["chat"]
