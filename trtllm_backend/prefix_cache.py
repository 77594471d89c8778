"""Automatic prefix caching: full KV blocks found again by their tokens and everything before them.

A full block is named by a chained hash: sha256 of the previous block's name, the block's token ids and (at the
root of the chain) the key of the weights that computed it (`weights_key`: which units ran quantized). Two
requests whose prompts share a prefix of whole blocks share those blocks, counted by reference; a block nobody
holds stays cached, least recently used first in `evictable`, until the pool needs it (KVPool.allocate).

The pool owns this object and keeps every held block's reference count here (cached or not): the block
manager's state is the pool's free lists, `refs` and `evictable`, and each block is in exactly one of them.

NOTE: exact by construction where it can be. A cached block is immutable: a request reuses at most the full
blocks before its last prompt token (that token is always computed, for its logits) and writes only into blocks
of its own. The weights key is part of the name, so KV computed while layers were INT4 is never reused once
they are restored (nor the reverse), and a request stops caching blocks once the weights change under it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

# How many names of evicted blocks are remembered (least recently evicted forgotten first): far more blocks than
# morphing can add to a pool, at ~0.2 KB a name.
EVICTED_NAMES = 4096


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: its parent's name and its token ids (sha256: no collision to fear, unlike a
    64-bit hash, so a hit is the same prefix)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_hash(weights_key: tuple) -> bytes:
    """The parent name of a request's first block: KV computed by other weights is another prefix."""
    return hashlib.sha256(repr(weights_key).encode()).digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start (blocks unless named tokens); a lookup is a request's admission."""

    lookups: int = 0
    hit_blocks: int = 0  # full prompt blocks found cached
    miss_blocks: int = 0  # full prompt blocks looked up and not found (they are computed)
    reused_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    evictions: int = 0
    # Missed blocks the cache had held and evicted (or that follow such a block in the prompt): what a cache that
    # kept them, a bigger pool, would have served. Most of the misses on multi-turn traffic whose pool is too small.
    evicted_miss_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        looked = self.hit_blocks + self.miss_blocks
        return self.hit_blocks / looked if looked else 0.0


class PrefixCache:
    """Names, reference counts and the LRU of unreferenced cached blocks. Engine thread only."""

    def __init__(self, block_size: int, enabled: bool = True, across_weights: bool = False):
        self.block_size = block_size
        self.enabled = enabled
        # Reuse KV computed under other bindings (kv_cache_reuse_across_morphs): a swap then keeps the cache, as it
        # keeps the KV of the requests running through it.
        self.across_weights = across_weights
        self.weights_key: tuple = ()  # the units bound quantized (set_weights)
        self.weights_version = 0  # bumped at each change of weights_key
        self.refs: dict[int, int] = {}  # held block -> block tables holding it
        self.block_of: dict[bytes, int] = {}  # name -> cached block
        self.name_of: dict[int, bytes] = {}  # cached block -> name
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self.evicted: OrderedDict[bytes, None] = OrderedDict()  # names of evicted blocks, most recent last
        self.stats = PrefixCacheStats()

    # ---- lookup (admission) ------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> tuple[list[int], list[bytes], int, int]:
        """(blocks, their names, full blocks looked up, missed blocks the cache had evicted): the cached blocks of
        the longest cached prefix of `tokens`, now referenced by the caller. At most the blocks before the last
        token: it is computed for its logits, and a reused block is never written. Counted by `count_lookup` once
        the request is admitted."""
        if not self.enabled:
            return [], [], 0, 0
        bs, name = self.block_size, root_hash(self.weights_key)
        looked = (len(tokens) - 1) // bs
        blocks, names = [], []
        i = 0
        for i in range(looked):
            name = block_hash(name, tokens[i * bs : (i + 1) * bs])
            b = self.block_of.get(name)
            if b is None:
                break
            blocks.append(b)
            names.append(name)
        evicted = 0
        if len(blocks) < looked and name in self.evicted:
            # The chain broke at an evicted block: count it and every later block still known (evicted or cached).
            evicted = 1
            for j in range(i + 1, looked):
                name = block_hash(name, tokens[j * bs : (j + 1) * bs])
                if name not in self.evicted and name not in self.block_of:
                    break
                evicted += 1
        for b in blocks:
            self.ref(b)
        return blocks, names, looked, evicted

    def count_lookup(self, reused: int, looked: int, evicted: int = 0) -> None:
        s = self.stats
        s.lookups += 1
        s.hit_blocks += reused
        s.miss_blocks += looked - reused
        s.reused_tokens += reused * self.block_size
        s.evicted_miss_blocks += evicted

    # ---- references ------------------------------------------------------------------------------
    def ref(self, block: int) -> None:
        n = self.refs.get(block, 0)
        if n == 0:
            self.evictable.pop(block, None)
        self.refs[block] = n + 1

    def unref(self, block: int) -> bool:
        """Drop one reference; True when the block is free for the pool (no reference, not cached)."""
        n = self.refs[block] - 1
        if n:
            self.refs[block] = n
            return False
        del self.refs[block]
        if block in self.name_of:
            self.evictable[block] = None  # most recently used end
            return False
        return True

    # ---- caching computed blocks --------------------------------------------------------------------
    def insert(self, name: bytes, block: int) -> int:
        """Cache a held, full, computed block under `name`; returns the block cached under that name (an earlier
        one when two requests computed the same prefix at once: this one then stays private)."""
        cached = self.block_of.setdefault(name, block)
        if cached == block:
            self.name_of[block] = name
            self.evicted.pop(name, None)
        return cached

    def evict(self) -> int:
        """Forget the least recently used unreferenced cached block; returns it (free for the pool)."""
        block, _ = self.evictable.popitem(last=False)
        self._forget(block)
        return block

    def drop(self, block: int) -> None:
        """Forget an unreferenced cached block (its segment is going away)."""
        del self.evictable[block]
        self._forget(block)

    def _forget(self, block: int) -> None:
        name = self.name_of.pop(block)
        del self.block_of[name]
        self.stats.evictions += 1
        self.evicted[name] = None
        self.evicted.move_to_end(name)
        if len(self.evicted) > EVICTED_NAMES:
            self.evicted.popitem(last=False)

    def move_all(self, moved: dict[int, int]) -> None:
        """Blocks' K/V now live elsewhere (src -> dst, a segment being drained): their references, names and
        places in the LRU order follow them (a cached block moved keeps its identity)."""
        for src, dst in moved.items():
            if src in self.refs:
                self.refs[dst] = self.refs.pop(src)
            name = self.name_of.pop(src, None)
            if name is not None:
                self.name_of[dst] = name
                self.block_of[name] = dst
        if any(src in self.evictable for src in moved):
            self.evictable = OrderedDict((moved.get(b, b), None) for b in self.evictable)

    # ---- the request's side --------------------------------------------------------------------------
    def set_weights(self, key: tuple) -> None:
        """The units bound quantized now (the engine calls it every iteration; a change names new blocks anew,
        unless KV is reused across weights)."""
        if key != self.weights_key and not self.across_weights:
            self.weights_key = key
            self.weights_version += 1

    def cache_computed(self, req) -> None:
        """Name and cache the request's blocks that are full and computed (prompt or generated tokens), as long as
        the weights stayed those its computation started with (`req.cache_version`)."""
        if not self.enabled or req.cache_version != self.weights_version:
            return
        bs, names = self.block_size, req.block_names
        full = req.num_computed // bs
        if len(names) >= full:
            return
        name = names[-1] if names else root_hash(self.weights_key)
        for i in range(len(names), full):
            name = block_hash(name, req.token_ids[i * bs : (i + 1) * bs])
            names.append(name)
            self.insert(name, req.block_table[i])
