"""invariants.BlockChecker (the incremental block check the engine runs each iteration) gives the verdict and
the report of the full scan, block_violations, after any sequence of changes: allocations and frees through
the pool's own paths, and corruptions written straight into the free lists and block tables."""

import random

import torch

from trtllm_backend.invariants import BlockChecker, block_violations
from trtllm_backend.kv_cache import KVSegment
from trtllm_backend.prefix_cache import PrefixCache


class _Pool:
    def __init__(self, sizes):
        self.segments, base = [], 0
        for n in sizes:
            self.segments.append(KVSegment(base, n, torch.empty(0), list(range(base + n - 1, base - 1, -1))))
            base += n
        self.cache = PrefixCache(block_size=4)  # references only: these tests share no block

    @property
    def num_blocks(self):
        return sum(s.num_blocks for s in self.segments)


def test_healthy_changes_stay_clean_and_corruptions_get_the_full_report():
    rng = random.Random(7)
    pool = _Pool([40, 24, 16])
    tables: list[list[int]] = [[] for _ in range(5)]
    checker = BlockChecker()
    corrupted = 0
    for step in range(3000):
        op = rng.random()
        seg = rng.choice(pool.segments)
        if op < 0.35 and seg.free:  # allocate from the end, as KVPool.allocate does
            b = seg.free.pop()
            pool.cache.refs[b] = 1
            rng.choice(tables).append(b)
        elif op < 0.7:  # free a table's blocks back to their segments
            t = rng.choice(tables)
            for b in t:
                next(s for s in pool.segments if s.owns(b)).free.append(b)
                pool.cache.refs.pop(b, None)
            t.clear()
        elif op < 0.8:  # a corruption of one kind or another, undone a few checks later by a full repair
            kind = rng.randrange(6)
            held = [b for t in tables for b in t]
            if kind == 0 and held:
                seg.free.append(rng.choice(held))  # held and free
            elif kind == 1 and seg.free:
                seg.free.append(seg.free[0])  # free twice
            elif kind == 2 and seg.free:
                seg.free.pop(0)  # lost: neither held nor free
            elif kind == 3:
                other = next(s for s in pool.segments if s is not seg)
                seg.free.append(other.base)  # a stray (possibly also free in its own segment)
            elif kind == 4 and len(seg.free) > 2:
                i = rng.randrange(len(seg.free) - 1)
                seg.free[i] = seg.free[i + 1]  # rewritten in the middle: a duplicate and a lost block
            elif kind == 5 and held:
                rng.choice(tables).append(rng.choice(held))  # one block in two tables (or twice in one)
            corrupted += 1
        else:  # repair: every block not in a table is free in its own segment, once
            held = set()
            for t in tables:
                t[:] = [b for b in dict.fromkeys(t) if b not in held]
                held.update(t)
            for s in pool.segments:
                s.free = [b for b in range(s.base + s.num_blocks - 1, s.base - 1, -1) if b not in held]
            pool.cache.refs = dict.fromkeys(held, 1)
        full = block_violations(pool, tables)
        assert checker.violations(pool, tables) == full, (step, full)
    assert corrupted > 100


def test_a_released_segment_and_a_new_one_are_checked_afresh():
    pool = _Pool([8, 8])
    checker = BlockChecker()
    assert checker.violations(pool, []) == []
    pool.segments.pop()
    assert checker.violations(pool, []) == []
    pool.segments.append(KVSegment(8, 8, torch.empty(0), list(range(15, 7, -1)) + [15]))  # listed twice
    found = checker.violations(pool, [])
    assert found == block_violations(pool, []) and any("listed twice" in line for line in found)
