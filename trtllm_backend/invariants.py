"""The engine's state invariants, checked between iterations (EngineConfig.check_invariants, on by default).
The block invariants are checked every iteration by BlockChecker at a cost that grows with what changed since the
last one (the block tables, and the free lists compared to their last checked copy in C); it defers to the full
scan, block_violations, for the report whenever anything may be wrong.

- memory: the account's resident bytes never exceed the budget, and match the tensors that exist;
- blocks: each block in exactly one state: held (a block in k block tables has k references, and no table holds
  a block twice), free (on its own segment's free list, once), or cached and unreferenced (evictable, and named
  in the prefix cache); held + free + evictable = the pool's size, and the cache's names map both ways;
- bindings: each layer slot (and the embedding / LM head table) is bound to a precision the manifest has for it, at no more bytes than the
  manifest's fragment, and the INT4 slots are exactly the layers the morph manager swapped.

Each check returns one line per broken invariant, with the state that shows it (empty when all hold).
"""

from __future__ import annotations

from collections import Counter

from .kv_cache import KVPool
from .layers import LayerSlot
from .manifest import Manifest
from .memory import MemoryAccount
from .precision import Precision


def layer_bytes(slots: list[LayerSlot]) -> int:
    return sum(s.weights.nbytes for s in slots)


def memory_violations(account: MemoryAccount, pool: KVPool, layers: int) -> list[str]:
    """layers: the bound weights' bytes (layer_bytes; the caller may keep it while no binding changes)."""
    out = []
    if account.used > account.budget:
        out.append(
            f"memory: {account.used} bytes accounted exceed the budget of {account.budget} "
            f"(layers {account.layers}, KV {account.kv}, staged {account.staged}, shared {account.shared})"
        )
    if account.layers != layers or account.kv != pool.nbytes:
        out.append(
            f"memory: the account says layers {account.layers} / KV {account.kv} bytes, the tensors hold "
            f"{layers} / {pool.nbytes}"
        )
    return out


def block_violations(pool: KVPool, block_tables: list[list[int]]) -> list[str]:
    out = []
    counts: Counter = Counter()
    for i, table in enumerate(block_tables):
        twice = sorted(b for b, n in Counter(table).items() if n > 1)
        if twice:
            out.append(f"blocks: {twice[:8]} are twice in block table {i}")
        counts.update(table)
    cache = pool.cache
    refs = cache.refs
    wrong = sorted(b for b in counts.keys() | refs.keys() if counts.get(b, 0) != refs.get(b, 0))
    if wrong:
        out.append(
            "blocks: reference counts differ from the block tables: "
            + ", ".join(f"block {b} in {counts.get(b, 0)} tables, {refs.get(b, 0)} references" for b in wrong[:8])
        )
    held = set(counts)
    free = [b for seg in pool.segments for b in seg.free]
    if len(free) != len(set(free)):
        out.append(f"blocks: {len(free) - len(set(free))} free blocks are listed twice")
    strays = [b for seg in pool.segments for b in seg.free if not seg.owns(b)]
    if strays:
        out.append(f"blocks: free blocks {strays[:8]} are on the free list of a segment that does not own them")
    both = held.intersection(free)
    if both:
        out.append(f"blocks: {sorted(both)[:8]} are both held and free")
    idle = set(cache.evictable)
    if idle & (held | set(free)):
        out.append(f"blocks: evictable blocks {sorted(idle & (held | set(free)))[:8]} are also held or free")
    unnamed = sorted(b for b in idle if b not in cache.name_of)
    if unnamed:
        out.append(f"blocks: evictable blocks {unnamed[:8]} are not cached under any name")
    bad_names = sorted(b for b, name in cache.name_of.items() if cache.block_of.get(name) != b)
    if bad_names or len(cache.block_of) != len(cache.name_of):
        out.append(
            f"blocks: the prefix cache's names do not map both ways ({len(cache.block_of)} names, "
            f"{len(cache.name_of)} named blocks, {bad_names[:8]} mismatched)"
        )
    if len(held) + len(set(free)) + len(idle) != pool.num_blocks:
        out.append(
            f"blocks: {len(held)} held + {len(set(free))} free + {len(idle)} evictable != {pool.num_blocks} in "
            f"the pool (segments {[(s.base, s.num_blocks, len(s.free)) for s in pool.segments]})"
        )
    return out


class BlockChecker:
    """block_violations, incrementally: the same verdict every call, but a free list equal to (or a prefix /
    an extension of) the one it checked last costs a C-level list comparison, not a scan in Python. Any
    doubt (a free list rewritten in the middle, a duplicate, a stray, a held block that is free, a count that
    does not add up) and the full block_violations gives the report, with its messages."""

    def __init__(self):
        # id(segment) -> (segment, the free list as last checked, the set of it); each a checked list: no
        # block twice and every block owned by its segment.
        self._free: dict[int, tuple] = {}

    def _free_set(self, seg) -> set[int] | None:
        """The segment's free blocks as a set, or None if its free list has a duplicate or a stray."""
        new, entry = seg.free, self._free.get(id(seg))
        if entry is not None and entry[0] is seg:
            _, old, blocks = entry
            n, k = len(new), len(old)
            if n == k and new == old:
                return blocks
            if n < k and new == old[:n]:  # blocks popped from the end (allocation)
                blocks.difference_update(old[n:])
                self._free[id(seg)] = (seg, new[:], blocks)
                return blocks
            if n > k and new[:k] == old:  # blocks appended (freed)
                added = new[k:]
                fresh = set(added)
                if (
                    len(fresh) == len(added)
                    and fresh.isdisjoint(blocks)
                    and seg.base <= min(added)
                    and max(added) < seg.base + seg.num_blocks
                ):
                    blocks.update(fresh)
                    self._free[id(seg)] = (seg, new[:], blocks)
                    return blocks
                del self._free[id(seg)]
                return None
        blocks = set(new)
        if len(blocks) != len(new) or (new and not (seg.base <= min(new) and max(new) < seg.base + seg.num_blocks)):
            self._free.pop(id(seg), None)
            return None
        self._free[id(seg)] = (seg, new[:], blocks)
        return blocks

    def violations(self, pool: KVPool, block_tables: list[list[int]]) -> list[str]:
        counts: Counter = Counter()
        ok = True
        for table in block_tables:
            counts.update(table)
            ok = ok and len(set(table)) == len(table)  # no block twice in one table
        cache = pool.cache
        ok = ok and counts == cache.refs  # shared blocks counted by reference
        held, idle = counts.keys(), cache.evictable.keys()
        ok = ok and held.isdisjoint(idle) and idle <= cache.name_of.keys() and len(cache.block_of) == len(cache.name_of)
        n_free = 0
        for seg in pool.segments:
            blocks = self._free_set(seg) if ok else None
            if blocks is None or not held.isdisjoint(blocks) or not idle.isdisjoint(blocks):
                ok = False
                break
            n_free += len(blocks)
        live = {id(seg) for seg in pool.segments}
        for key in [k for k in self._free if k not in live]:  # released segments
            del self._free[key]
        if ok and len(held) + n_free + len(idle) == pool.num_blocks:
            return []
        return block_violations(pool, block_tables)


def binding_violations(slots: list[LayerSlot], manifest: Manifest, swapped_layers: list[int]) -> list[str]:
    out = []
    for slot in slots:
        have = manifest.precisions(slot.index)
        if slot.precision not in have:
            out.append(f"binding: layer {slot.index} is bound to {slot.precision}, the manifest has {sorted(have)}")
            continue
        limit = manifest.fragment(slot.index, Precision(slot.precision))["bytes"]
        if slot.weights.nbytes > limit:
            out.append(
                f"binding: layer {slot.index} ({slot.precision}) holds {slot.weights.nbytes} bytes, its "
                f"fragment {limit}"
            )
    int4 = sorted(s.index for s in slots if s.precision == Precision.INT4)
    if int4 != sorted(swapped_layers):
        out.append(f"binding: INT4 layers {int4} but the morph manager swapped {sorted(swapped_layers)}")
    return out


def head_violations(model, manifest: Manifest, account: MemoryAccount, swapped: bool) -> list[str]:
    """The tied embedding / LM head: bound to a precision the manifest has, INT8 exactly when the morph manager
    swapped it, no more bytes than its fragment, and the account's shared bytes those of the tensors."""
    head, out = model.head, []
    if head.precision not in manifest.head_precisions():
        out.append(f"binding: lm_head is bound to {head.precision}, the manifest has {manifest.head_precisions()}")
    elif head.precision != Precision.FULL and head.table.nbytes > manifest.head_fragment(head.precision)["bytes"]:
        out.append(
            f"binding: lm_head ({head.precision}) holds {head.table.nbytes} bytes, its fragment "
            f"{manifest.head_fragment(head.precision)['bytes']}"
        )
    if (head.precision == Precision.INT8) != swapped:
        out.append(
            f"binding: lm_head is {head.precision} but the morph manager {'swapped' if swapped else 'did not swap'} it"
        )
    if account.shared != model.shared_nbytes:
        out.append(f"memory: the account says shared {account.shared} bytes, the tensors hold {model.shared_nbytes}")
    return out
