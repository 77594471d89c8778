"""Paged KV cache: a pool of segments of cross-layer blocks, and the block manager.

A block holds K and V of `block_size` tokens for *all* layers, so bytes freed anywhere become blocks every
layer can use. Inside a segment the memory is layer-major ([layer, k|v, slot, kv_head, head_dim]) so one
layer's keys are a single index_select away; the block is still the unit of allocation and accounting.
Block ids are global and stable: segment s owns ids [base, base + num_blocks); slot ids (block * block_size +
offset) are global too, and the pool maps them to (segment, local slot) for the attention plan.
Every block is in exactly one state: free (on its segment's free list), held (reference counted in `cache.refs`:
block tables may share a cached prefix), or cached and unreferenced (`cache.evictable`: resident, reusable, and
given up least recently used first when blocks are needed; trtllm_backend/prefix_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import huge_pages
from .manifest import ModelConfig
from .prefix_cache import PrefixCache


@dataclass(slots=True)
class KVSegment:
    base: int  # first global block id
    num_blocks: int
    kv: torch.Tensor  # [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]
    free: list[int] = field(default_factory=list)  # global ids, popped from the end
    draining: bool = False  # no new allocations; released once empty
    nbytes: int = field(init=False)  # of kv, fixed for the segment's life (read several times an iteration)

    def __post_init__(self):
        self.nbytes = self.kv.numel() * self.kv.element_size()

    def owns(self, block: int) -> bool:
        return self.base <= block < self.base + self.num_blocks


# One piece of a slot access: (segment tensor, rows of the output/input it serves or None for all, local slots).
SlotPiece = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]


class KVPool:
    """Owns the segments and hands out blocks. Not thread-safe: used by the engine thread only."""

    def __init__(
        self,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: str = "cpu",
        huge_pages: bool = True,
        prefix_caching: bool = True,
        reuse_across_weights: bool = False,
    ):
        self.config = config
        self.cache = PrefixCache(block_size, prefix_caching, reuse_across_weights)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.huge_pages = huge_pages
        self.segments: list[KVSegment] = []
        self._next_base = 0
        self._num_blocks = 0  # sum over segments, kept by add_segment / release_segment (read every iteration)
        self._starts: tuple[torch.Tensor, torch.Tensor] | None = None  # locate_slots' tensors; reset with the segments

    # ---- sizing -------------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.config.kv_bytes_per_token(itemsize) * self.block_size

    def blocks_for_bytes(self, nbytes: int) -> int:
        return nbytes // self.bytes_per_block

    # ---- segments -----------------------------------------------------------------------------------
    def add_segment(self, num_blocks: int) -> KVSegment:
        c = self.config
        # NOTE: empty, not zeros: every slot is written before it is read (paged_attention writes the new
        # tokens first and gathers only written positions), and untouched pages cost no RSS (on 2 MiB pages a
        # first write makes a whole page of one layer's K or V resident; the account counts the segment anyway).
        shape = (c.num_layers, 2, num_blocks * self.block_size, c.num_kv_heads, c.head_dim)
        if self.huge_pages and self.device == "cpu":  # scattered blocks: fewer TLB misses (trtllm_backend.huge_pages)
            kv = huge_pages.empty_tensor(shape, self.dtype)
        else:
            kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        seg = KVSegment(self._next_base, num_blocks, kv)
        # Lowest ids are handed out first: they are popped from the end of the list.
        seg.free = list(range(seg.base + num_blocks - 1, seg.base - 1, -1))
        self._next_base += num_blocks
        self.segments.append(seg)
        self._num_blocks += num_blocks
        self._starts = None
        return seg

    def release_segment(self, seg: KVSegment) -> None:
        if len(seg.free) != seg.num_blocks:
            raise RuntimeError(f"segment at block {seg.base} still holds {seg.num_blocks - len(seg.free)} live blocks")
        self.segments.remove(seg)
        self._num_blocks -= seg.num_blocks
        self._starts = None

    def segment_of(self, block: int) -> KVSegment:
        for seg in self.segments:
            if seg.owns(block):
                return seg
        raise KeyError(f"block {block} belongs to no segment")

    # ---- slots -> segments ----------------------------------------------------------------------------
    def split_slots(self, slots: torch.Tensor) -> list[SlotPiece]:
        """Global slot ids -> (segment tensor, rows, local slots), grouped by segment; rows is None when one
        segment serves them all (the common case: no index_copy needed)."""
        bs = self.block_size
        segs = self.segments
        if len(segs) == 1:
            return [(segs[0].kv, None, slots - segs[0].base * bs)]
        bounds = torch.tensor([s.base * bs for s in segs[1:]], dtype=slots.dtype)
        which = torch.bucketize(slots, bounds, right=True)
        pieces = []
        for i, seg in enumerate(segs):
            rows = (which == i).nonzero().flatten()
            if rows.numel() == 0:
                continue
            if rows.numel() == slots.numel():
                return [(seg.kv, None, slots - seg.base * bs)]
            pieces.append((seg.kv, rows, slots[rows] - seg.base * bs))
        return pieces

    def locate_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slot ids -> (index into `segments`, slot within that segment), same shape."""
        if len(self.segments) == 1:  # the common case: fewer torch calls (each one misses after a forward)
            base = self.segments[0].base * self.block_size
            return torch.zeros_like(slots), (slots - base if base else slots)
        if self._starts is None:  # segment start slots, and the bounds after the first, until segments change
            starts = torch.tensor([s.base * self.block_size for s in self.segments], dtype=torch.long)
            self._starts = (starts, starts[1:])
        starts, bounds = self._starts
        which = torch.bucketize(slots, bounds, right=True)
        return which, slots - starts[which]

    # ---- blocks -------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_allocatable(self) -> int:
        """Blocks a request can get outside draining segments, cached unreferenced ones included."""
        free = sum(len(s.free) for s in self.segments if not s.draining)
        idle = self.num_evictable
        if idle and any(s.draining for s in self.segments):  # rare (a restore under way): count those that stay
            idle = sum(1 for b in self.cache.evictable if not self.segment_of(b).draining)
        return free + idle

    @property
    def num_free(self) -> int:
        """Blocks on the free lists (not counting cached unreferenced ones: see num_evictable)."""
        return sum(len(s.free) for s in self.segments)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request holds: resident, but free for anyone who needs blocks."""
        return len(self.cache.evictable)

    @property
    def num_used(self) -> int:
        """Blocks some request holds: the KV the load needs (cached blocks nobody holds count as free, as in
        vLLM's usage)."""
        return self.num_blocks - self.num_free - self.num_evictable

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, all or nothing, earliest segments first, each with one reference. Free blocks first, then
        cached ones nobody holds, least recently used first. Draining segments are the last resort: a restore
        waits longer rather than a request being preempted."""
        free = self.num_free
        if n > free + self.num_evictable:
            return None
        for _ in range(n - free):
            b = self.cache.evict()
            self.segment_of(b).free.append(b)
        out: list[int] = []
        for seg in sorted(self.segments, key=lambda s: s.draining):  # stable: keeps segment order
            while seg.free and len(out) < n:
                out.append(seg.free.pop())
            if len(out) == n:
                break
        refs = self.cache.refs
        for b in out:
            refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a block table given back). A block nobody holds goes back to the
        free list, or stays cached if it is. NOTE: last block first, so a prefix's tail is evicted before its
        head (the head is what other requests share)."""
        cache = self.cache
        for b in reversed(blocks):
            if cache.unref(b):
                self.segment_of(b).free.append(b)

    def evacuate(self, seg: KVSegment, block_tables: list[list[int]]) -> bool:
        """Move the live blocks of `seg` that `block_tables` hold into free blocks of segments that are not
        draining, rewriting those tables in place (a block shared by several tables moves once); marks `seg`
        draining so nothing new lands in it. Cached unreferenced blocks of `seg` move too, hottest first, while
        there is room no hotter cached block pays for; the rest are dropped: a shrink gives up the coldest cached
        blocks of the whole pool, never a hot prefix. A moved block keeps its references, its name and its place
        in the LRU order. True once every block of `seg` is free (it can be released); False if there was no room
        for all the live blocks yet (what moved stays moved: call again later)."""
        seg.draining = True
        cache = self.cache
        moved: dict[int, int] = {}
        try:
            for table in block_tables:
                for i, b in enumerate(table):
                    if not seg.owns(b):
                        continue
                    if b not in moved:
                        new = self._room_for_move()
                        if new is None:
                            return False
                        self.copy_block(b, new)
                        moved[b] = new
                    table[i] = moved[b]
            idle = [b for b in cache.evictable if seg.owns(b)]  # coldest first
            if idle:
                rank = {b: i for i, b in enumerate(cache.evictable)}
                for b in reversed(idle):  # hottest first
                    new = self._room_for_move(rank, rank[b])
                    if new is None:
                        cache.drop(b)
                        seg.free.append(b)
                    else:
                        self.copy_block(b, new)
                        moved[b] = new
            return len(seg.free) + len(moved) == seg.num_blocks
        finally:
            if moved:
                cache.move_all(moved)
                seg.free.extend(moved)

    def _room_for_move(self, rank: dict[int, int] | None = None, colder_than: int = 0) -> int | None:
        """A block outside draining segments to move K/V into: a free one, else the least recently used cached
        unreferenced one (forgotten), if its LRU `rank` is below `colder_than`, the moving block's (no rank: a
        live block, which must move whatever is cached). None if there is no such room."""
        dst = next((s for s in self.segments if s.free and not s.draining), None)
        if dst is not None:
            return dst.free.pop()
        for b in self.cache.evictable:
            if rank is not None and rank[b] >= colder_than:
                return None
            if not self.segment_of(b).draining:
                self.cache.drop(b)
                return b
        return None

    def copy_block(self, src: int, dst: int) -> None:
        """Move the K/V of one block (all layers) to another block, possibly in another segment."""
        s_seg, d_seg = self.segment_of(src), self.segment_of(dst)
        bs = self.block_size
        s0, d0 = (src - s_seg.base) * bs, (dst - d_seg.base) * bs
        d_seg.kv[:, :, d0 : d0 + bs].copy_(s_seg.kv[:, :, s0 : s0 + bs])
