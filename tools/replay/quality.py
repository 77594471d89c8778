"""The quality column: perplexity against the number of INT4 layers, from `python -m tools.eval_quality`'s table.

results/quality/quality.json holds `serving_curve` (perplexity at every k = 0..num_layers for the swap order
the server uses, the manifest's LIS order) and `by_order` ({order: {k: ppl}} at a few k). For order "lis" the
serving curve is used; another order is looked up by name (case-insensitive) and, where its k are sparse,
interpolated linearly (the report says so). A few other natural layouts are accepted too:
  {"lis": [ppl_0, ppl_1, ...]}       {"orders": {"lis": [{"k": 0, "perplexity": ppl_0}, ...]}}
  [{"order": "lis", "k": 0, "ppl": ...}, ...]
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_QUALITY = "results/quality/quality.json"
SERVING_ALIASES = ("lis", "serving")  # names for "the order the server swaps in"
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
        if order.lower() in SERVING_ALIASES and isinstance(data.get("serving_curve"), (dict, list)):
            return _as_table(data["serving_curve"])
        for key, v in data.items():
            if key.lower() == order.lower():
                return _as_table(v)
        for v in data.values():
            found = _find(v, order, depth + 1)
            if found:
                return found
    if isinstance(data, list) and data and all(isinstance(r, dict) and "order" in r for r in data):
        return _as_table([r for r in data if str(r["order"]).lower() == order.lower()])
    return None


def interpolate(table: dict[int, float]) -> dict[int, float]:
    """Every k from 0 to the largest, linear between the measured ones."""
    ks = sorted(table)
    out = dict(table)
    for a, b in zip(ks, ks[1:]):
        for k in range(a + 1, b):
            out[k] = table[a] + (table[b] - table[a]) * (k - a) / (b - a)
    return out


def load_quality(path: str | Path, order: str = "lis") -> tuple[dict[int, float] | None, str]:
    """(perplexity by INT4-layer count, a note for the report); the table is None when unusable."""
    path = Path(path)
    if not path.exists():
        return None, f"quality n/a: {path.name} not found (run python -m tools.eval_quality first)"
    try:
        table = _find(json.loads(path.read_text()), order)
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"quality n/a: cannot read {path.name}: {exc}"
    if not table or 0 not in table:
        return None, f"quality n/a: no perplexity table for order {order!r} (with k = 0) in {path.name}"
    full = interpolate(table)
    gaps = len(full) - len(table)
    return full, (
        f"quality: perplexity by INT4 layers (order {order!r}, k = 0..{max(table)}) from {path.name}"
        + (f"; {gaps} k interpolated linearly" if gaps else "")
        + f"; full precision {table[0]:.3f}"
    )
