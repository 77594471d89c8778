"""One memory budget for resident weights, fragments being prepared, and KV segments.

The account is computed from the tensors that exist, not estimated, and is checked before anything is
allocated: a fragment is staged only if its bytes (an upper bound from the manifest) fit, and a KV segment
is only as large as what is left. `reserve` is headroom for staging one quantized fragment while the
full-precision one is still bound (without it the first swap could not start under an exactly-full budget).

The arithmetic lives here, apart from what is counted (morph.py counts the tensors): `resolve_budget` sizes the
budget at load, `MemoryAccount.update` records what is resident and refuses an account over the budget.
"""

from __future__ import annotations

from dataclasses import dataclass


def resolve_budget(
    full_model: int,
    *,
    reserve: int,
    bytes_per_block: int,
    base_kv_blocks: int,
    given: int | None = None,
    policy_name: str = "",
) -> int:
    """The memory budget: `given` (memory_budget_bytes), or by default the full-precision model (`full_model`
    bytes) plus `base_kv_blocks` KV blocks. Refused (ValueError naming the parameter) when it cannot hold that
    model, the staging `reserve` and one KV block."""
    least = full_model + reserve + bytes_per_block
    budget = given or full_model + base_kv_blocks * bytes_per_block
    if budget < least:
        what = (
            f"memory_budget_bytes: {budget}"
            if given
            else f"max_tokens_in_paged_kv_cache: {base_kv_blocks} blocks ({budget} bytes with the model)"
        )
        staging = f" plus the {reserve}-byte staging reserve of policy {policy_name}" if reserve else ""
        raise ValueError(
            f"{what} is below the full-precision model ({full_model} bytes){staging} plus one KV block "
            f"({bytes_per_block} bytes): {least} bytes at least"
        )
    return budget


def blocks_freed(full_bytes: int, quant_bytes: int, bytes_per_block: int) -> int:
    """Whole KV blocks that swapping a `full_bytes` unit for its `quant_bytes` form pays for."""
    return max(0, (full_bytes - quant_bytes) // bytes_per_block)


@dataclass(slots=True)
class MemoryAccount:
    budget: int  # 0 until resolved: nothing is checked against it then
    reserve: int  # kept free for staging one fragment
    shared: int = 0
    layers: int = 0
    staged: int = 0
    kv: int = 0

    @property
    def used(self) -> int:
        return self.shared + self.layers + self.staged + self.kv

    @property
    def available(self) -> int:
        """Bytes that can become KV blocks now (the staging reserve excluded)."""
        return self.budget - self.reserve - self.used

    def fits(self, extra: int) -> bool:
        """Whether `extra` bytes (a fragment to stage) fit the budget, the staging reserve included."""
        return self.used + extra <= self.budget

    def update(self, *, shared: int, layers: int, kv: int, staged: int) -> None:
        """Record what is resident now (counted from the tensors). An account over its budget raises
        AssertionError: never expected, since every allocation is checked with `fits` / `available` first."""
        self.shared, self.layers, self.kv, self.staged = shared, layers, kv, staged
        if self.budget and self.used > self.budget:
            raise AssertionError(f"memory account {self.used} exceeds the budget {self.budget}")
