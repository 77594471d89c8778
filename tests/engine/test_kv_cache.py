import pytest
import torch

from trtllm_backend.kv_cache import KVPool
from trtllm_backend.manifest import ModelConfig

TINY = ModelConfig(
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    vocab_size=32,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=1,
)


def pool(blocks=11, bs=4) -> KVPool:
    p = KVPool(TINY, bs, torch.float32)
    p.add_segment(blocks)
    return p


def test_allocate_is_all_or_nothing_and_reports_usage():
    p = pool()
    a = p.allocate(8)
    assert a == list(range(8)) and p.num_used == 8 and p.num_free == 3
    assert p.allocate(4) is None and p.num_free == 3
    p.free(a[:2])
    assert p.num_free == 5 and p.num_used == 6


def test_block_bytes_cover_all_layers():
    p = pool(blocks=3, bs=4)
    assert p.bytes_per_block == 2 * 2 * 1 * 4 * 4 * 4  # k|v x layers x kv_heads x head_dim x block x fp32
    assert p.nbytes == 3 * p.bytes_per_block
    assert p.blocks_for_bytes(p.bytes_per_block * 2 + 1) == 2


def test_segments_have_global_stable_ids_and_drain():
    p = pool(blocks=2)
    s2 = p.add_segment(3)
    assert s2.base == 2 and p.num_blocks == 5
    got = p.allocate(4)
    assert sorted(got) == [0, 1, 2, 3]
    s2.draining = True
    assert p.num_allocatable == 0
    assert p.allocate(1) == [4]  # a draining segment still serves when nothing else can (no preemption)
    p.free([4])
    with pytest.raises(RuntimeError, match="live blocks"):
        p.release_segment(s2)
    p.free([2, 3])
    p.release_segment(s2)
    assert p.num_blocks == 2
    s3 = p.add_segment(1)
    assert s3.base == 5  # ids are never reused while anything could still refer to them


def test_copy_block_moves_all_layers_across_segments():
    p = pool(blocks=2, bs=2)
    s2 = p.add_segment(2)
    p.segments[0].kv.zero_()  # segments are allocated uninitialised
    s2.kv[:, :, 0:2].fill_(7.0)  # block 2 (first of the second segment)
    p.copy_block(2, 1)
    assert torch.all(p.segments[0].kv[:, :, 2:4] == 7.0)
    assert torch.all(p.segments[0].kv[:, :, 0:2] == 0.0)


def test_evacuate_moves_live_blocks_and_rewrites_the_tables():
    p = pool(blocks=3, bs=2)
    s2 = p.add_segment(3)  # blocks 3..5
    p.segments[0].kv.zero_()
    a = p.allocate(3)  # fills the base segment: 0, 1, 2
    b = p.allocate(2)  # 3, 4 from the second
    s2.kv[:, :, 2:4].fill_(5.0)  # block 4's K/V
    tables = [a[:1] + b[:1], a[1:] + b[1:]]
    assert not p.evacuate(s2, tables)  # no free block outside s2 yet: nothing can move
    assert s2.draining and tables == [[0, 3], [1, 2, 4]] and p.num_used == 5
    p.free([a[0]])  # the first table is done with block 0
    tables[0] = [3]
    assert not p.evacuate(s2, tables)  # one block moved (3 -> 0), block 4 still waits for room
    assert tables == [[0], [1, 2, 4]]
    p.free([1])
    tables[1] = [2, 4]
    assert p.evacuate(s2, tables)  # block 4 -> 1, and the segment is empty
    assert tables == [[0], [2, 1]] and len(s2.free) == s2.num_blocks
    assert torch.all(p.segments[0].kv[:, :, 2:4] == 5.0)  # block 1 now holds what block 4 held
    p.release_segment(s2)
    assert p.num_blocks == 3 and p.num_used == 3


def test_evacuate_never_moves_into_another_draining_segment():
    p = pool(blocks=1, bs=2)
    s2, s3 = p.add_segment(2), p.add_segment(2)
    p.allocate(1)  # the base segment is full
    live = p.allocate(1)
    assert p.segment_of(live[0]) is s2
    s3.draining = True
    assert not p.evacuate(s2, [live]) and live == [1]


def test_slots_map_to_segments():
    p = pool(blocks=2, bs=4)  # slots 0..7
    p.add_segment(3)  # slots 8..19
    slots = torch.tensor([1, 9, 7, 19, 8])
    which, local = p.locate_slots(slots)
    assert which.tolist() == [0, 1, 0, 1, 1] and local.tolist() == [1, 1, 7, 11, 0]
    pieces = p.split_slots(slots)
    assert [(kv is p.segments[i].kv, rows.tolist(), loc.tolist()) for i, (kv, rows, loc) in enumerate(pieces)] == [
        (True, [0, 2], [1, 7]),
        (True, [1, 3, 4], [1, 11, 0]),
    ]
    ((kv, rows, local),) = p.split_slots(torch.tensor([8, 10]))  # one segment serves them all: no rows
    assert kv is p.segments[1].kv and rows is None and local.tolist() == [0, 2]


def test_slot_lookup_follows_segments_added_and_released():
    p = pool(blocks=2, bs=4)  # slots 0..7
    p.add_segment(3)  # slots 8..19
    assert p.locate_slots(torch.tensor([9]))[0].tolist() == [1]
    p.add_segment(1)  # slots 20..23
    which, local = p.locate_slots(torch.tensor([21, 9, 0]))
    assert which.tolist() == [2, 1, 0] and local.tolist() == [1, 1, 0]
    p.release_segment(p.segments[1])  # slots 8..19 gone; 20..23 now the second segment
    which, local = p.locate_slots(torch.tensor([21, 7]))
    assert which.tolist() == [1, 0] and local.tolist() == [1, 7]


def test_slots_map_to_the_only_segment_wherever_it_starts():
    p = pool(blocks=2, bs=4)  # slots 0..7
    which, local = p.locate_slots(torch.tensor([[1, 7], [0, 5]]))
    assert which.dtype == torch.long and which.tolist() == [[0, 0], [0, 0]] and local.tolist() == [[1, 7], [0, 5]]
    p.add_segment(3)  # slots 8..19
    p.release_segment(p.segments[0])  # the one left starts at block 2
    which, local = p.locate_slots(torch.tensor([8, 19, 10]))
    assert which.tolist() == [0, 0, 0] and local.tolist() == [0, 11, 2]


def test_decode_slot_table_matches_the_per_position_one():
    """attention._decode_slots (per position for small plans, torch ops on the block tables for larger ones;
    both occur here) equals the slots listed position by position, padding included (a sequence's own first
    slot), for mixed context lengths and block sizes."""
    import random

    from trtllm_backend.attention import SLOT_LOOP_MAX, SeqSlice, _decode_slots, _slots

    rng = random.Random(1)
    sizes = set()
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 16])
        dec = []
        for i in range(rng.randint(1, 8)):
            ctx = rng.randint(1, rng.choice([70, 900]))
            dec.append(SeqSlice(i, 1, ctx, rng.sample(range(2000), -(-ctx // bs))))
        L = max(s.ctx_len for s in dec)
        sizes.add(len(dec) * L > SLOT_LOOP_MAX)
        rows = [_slots(s.block_table, 0, s.ctx_len, bs) for s in dec]
        want = torch.tensor([r + r[:1] * (L - len(r)) for r in rows], dtype=torch.long)
        got = _decode_slots(dec, L, bs, torch.tensor([s.ctx_len for s in dec]))
        assert got.is_contiguous() and torch.equal(got, want)
    assert sizes == {False, True}


def test_decode_locations_equal_the_slot_table_located_in_the_segments():
    """attention._decode_locations (segment and local slot of every decode position, built in Python) equals
    KVPool.locate_slots of attention._decode_slots, padding included, over pools of one to four segments and
    with a segment released in the middle."""
    import random

    from trtllm_backend.attention import SeqSlice, _decode_locations, _decode_slots

    rng = random.Random(2)
    for trial in range(120):
        bs = rng.choice([1, 2, 4, 16])
        p = pool(blocks=rng.randint(8, 40), bs=bs)
        for _ in range(rng.randint(0, 3)):
            p.add_segment(rng.randint(4, 40))
        if trial % 3 == 0 and len(p.segments) > 2:
            p.release_segment(p.segments[1])
        owned = [b for seg in p.segments for b in range(seg.base, seg.base + seg.num_blocks)]
        dec = []
        for i in range(rng.randint(1, 6)):
            ctx = rng.randint(1, 6 * bs)
            dec.append(SeqSlice(i, 1, ctx, rng.sample(owned, -(-ctx // bs))))
        L = max(s.ctx_len for s in dec)
        which, local = p.locate_slots(_decode_slots(dec, L, bs, torch.tensor([s.ctx_len for s in dec])))
        got_which, got_local = _decode_locations(p, dec, L)
        assert got_which.is_contiguous() and got_local.is_contiguous()
        assert torch.equal(got_which, which) and torch.equal(got_local, local)


def test_decode_locations_name_a_block_outside_the_pool():
    from trtllm_backend.attention import SeqSlice, _decode_locations

    p = pool(blocks=4, bs=2)
    with pytest.raises(KeyError, match="block 9 belongs to no segment"):
        _decode_locations(p, [SeqSlice(0, 1, 3, [1, 9])], 3)
