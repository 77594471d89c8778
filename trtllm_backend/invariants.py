"""The engine's state invariants, checked between iterations (EngineConfig.check_invariants, on by default:
a few hundred set operations per iteration).

- memory: the account's resident bytes never exceed the budget, and match the tensors that exist;
- blocks: no block in two block tables, none both held and free, free + used = the pool's size;
- bindings: each layer slot (and the embedding / LM head table) is bound to a precision the manifest has for it, at no more bytes than the
  manifest's fragment, and the INT4 slots are exactly the layers the morph manager swapped.

Each check returns one line per broken invariant, with the state that shows it (empty when all hold).
"""
from __future__ import annotations

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
        out.append(f"memory: {account.used} bytes accounted exceed the budget of {account.budget} "
                   f"(layers {account.layers}, KV {account.kv}, staged {account.staged}, shared {account.shared})")
    if account.layers != layers or account.kv != pool.nbytes:
        out.append(f"memory: the account says layers {account.layers} / KV {account.kv} bytes, the tensors hold "
                   f"{layers} / {pool.nbytes}")
    return out


def block_violations(pool: KVPool, block_tables: list[list[int]]) -> list[str]:
    out = []
    held: set[int] = set()
    for i, table in enumerate(block_tables):
        twice = held.intersection(table) | {b for b in table if table.count(b) > 1}
        if twice:
            out.append(f"blocks: {sorted(twice)[:8]} are in two block tables (table {i})")
        held.update(table)
    free = [b for seg in pool.segments for b in seg.free]
    if len(free) != len(set(free)):
        out.append(f"blocks: {len(free) - len(set(free))} free blocks are listed twice")
    strays = [b for seg in pool.segments for b in seg.free if not seg.owns(b)]
    if strays:
        out.append(f"blocks: free blocks {strays[:8]} are on the free list of a segment that does not own them")
    both = held.intersection(free)
    if both:
        out.append(f"blocks: {sorted(both)[:8]} are both held and free")
    if len(held) + len(set(free)) != pool.num_blocks:
        out.append(f"blocks: {len(held)} held + {len(set(free))} free != {pool.num_blocks} in the pool "
                   f"(segments {[(s.base, s.num_blocks, len(s.free)) for s in pool.segments]})")
    return out


def binding_violations(slots: list[LayerSlot], manifest: Manifest, swapped_layers: list[int]) -> list[str]:
    out = []
    for slot in slots:
        have = manifest.precisions(slot.index)
        if slot.precision not in have:
            out.append(f"binding: layer {slot.index} is bound to {slot.precision}, the manifest has {sorted(have)}")
            continue
        limit = manifest.fragment(slot.index, Precision(slot.precision))["bytes"]
        if slot.weights.nbytes > limit:
            out.append(f"binding: layer {slot.index} ({slot.precision}) holds {slot.weights.nbytes} bytes, its "
                       f"fragment {limit}")
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
        out.append(f"binding: lm_head ({head.precision}) holds {head.table.nbytes} bytes, its fragment "
                   f"{manifest.head_fragment(head.precision)['bytes']}")
    if (head.precision == Precision.INT8) != swapped:
        out.append(f"binding: lm_head is {head.precision} but the morph manager {'swapped' if swapped else 'did not swap'} it")
    if account.shared != model.shared_nbytes:
        out.append(f"memory: the account says shared {account.shared} bytes, the tensors hold {model.shared_nbytes}")
    return out
