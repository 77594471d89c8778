"""Request priority classes (vLLM's `priority`): lower is more important; each value is a class with its own
metrics. Kept free of torch so the launcher's side (parameters) can check a cutoff without loading the engine."""

from __future__ import annotations

PRIORITY_MIN, PRIORITY_MAX = -10, 10


def is_priority(value) -> bool:
    """An int (not a bool) in [PRIORITY_MIN, PRIORITY_MAX]."""
    return not isinstance(value, bool) and isinstance(value, int) and PRIORITY_MIN <= value <= PRIORITY_MAX
