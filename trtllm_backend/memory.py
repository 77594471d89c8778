"""One memory budget for resident weights, fragments being prepared, and KV segments.

The account is computed from the tensors that exist, not estimated, and is checked before anything is
allocated: a fragment is staged only if its bytes (an upper bound from the manifest) fit, and a KV segment
is only as large as what is left. `reserve` is headroom for staging one quantized fragment while the
full-precision one is still bound (without it the first swap could not start under an exactly-full budget).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MemoryAccount:
    budget: int
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
