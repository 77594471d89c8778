"""The quality column: perplexity against the number of INT4 layers, from tools/eval_quality.py's table.

The table is results/quality/quality.json; we need, for one swap order (default "lis", the order in the
manifest), perplexity at k = 0..num_layers INT4 layers. The reader accepts the layouts such a table
naturally takes, so the two tools need not change in lock-step:
  {"orders": {"lis": [ppl_0, ppl_1, ...]}}        {"lis": {"0": ppl_0, "1": ppl_1, ...}}
  {"orders": {"lis": [{"k": 0, "perplexity": ppl_0}, ...]}}       [{"order": "lis", "k": 0, "ppl": ...}, ...]
"""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_QUALITY = "results/quality/quality.json"
_K_KEYS = ("k", "int4_layers", "num_int4_layers", "layers")
_PPL_KEYS = ("perplexity", "ppl")


def _as_table(value) -> dict[int, float] | None:
    if isinstance(value, dict):
        for key in ("perplexity", "ppl", "table", "by_k"):  # a wrapper around the table itself
            if key in value and isinstance(value[key], (list, dict)):
                return _as_table(value[key])
        try:
            return {int(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            return None
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return {k: float(v) for k, v in enumerate(value)}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        rows = {}
        for row in value:
            k = next((row[key] for key in _K_KEYS if key in row), None)
            p = next((row[key] for key in _PPL_KEYS if key in row), None)
            if k is None or p is None:
                return None
            rows[int(k)] = float(p)
        return rows
    return None


def _find(data, order: str, depth: int = 0):
    if depth > 4:
        return None
    if isinstance(data, dict):
        if order in data:
            return _as_table(data[order])
        for v in data.values():
            found = _find(v, order, depth + 1)
            if found:
                return found
    if isinstance(data, list) and data and all(isinstance(r, dict) and "order" in r for r in data):
        return _as_table([r for r in data if r["order"] == order])
    return None


def load_quality(path: str | Path, order: str = "lis") -> tuple[dict[int, float] | None, str]:
    """(perplexity by INT4-layer count, a note for the report); the table is None when unusable."""
    path = Path(path)
    if not path.exists():
        return None, f"quality n/a: {path.name} not found (run tools/eval_quality.py first)"
    try:
        table = _find(json.loads(path.read_text()), order)
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"quality n/a: cannot read {path}: {exc}"
    if not table or 0 not in table:
        return None, f"quality n/a: no perplexity table for order {order!r} (with k = 0) in {path}"
    return table, f"quality: perplexity by INT4 layers, order {order!r}, from {path.name} (k = {min(table)}..{max(table)})"
