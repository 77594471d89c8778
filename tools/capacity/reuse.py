"""Capacity with and without prefix reuse: each policy beside its `+prefix=off` variant (prefix caching off,
the same memory and seeds), as the ratio of its capacity with reuse to without, paired by seed."""

from __future__ import annotations

from tools.capacity.analysis import PolicyResult
from tools.capacity.stats import ratio_interval

OFF = "+prefix=off"


def pairs(cell: dict[str, PolicyResult]) -> list[tuple[PolicyResult, PolicyResult]]:
    """(with reuse, without) for every policy measured both ways, in the cell's order."""
    return [(cell[p.replace(OFF, "")], r) for p, r in cell.items() if OFF in p and p.replace(OFF, "") in cell]


def _share(r: PolicyResult) -> float | None:
    vals = [n["prefix_reused_share"] for n in r.at_capacity if n["prefix_reused_share"] == n["prefix_reused_share"]]
    return sum(vals) / len(vals) if vals else None


def section(cell: dict[str, PolicyResult]) -> tuple[list[str], dict]:
    found = pairs(cell)
    if not found:
        return [], {}
    lines = [
        "Prefix reuse: each policy with prefix caching (as measured above) and its `+prefix=off` variant "
        "(`enable_kv_cache_reuse=false`), same memory and seeds:",
        "",
        "| policy | capacity with reuse | without | with / without [95% CI] | per seed with / without "
        "| prompt tokens reused at capacity (with) |",
        "|---" * 6 + "|",
    ]
    data = {}
    for on, off in found:
        a = {s.seed: s.capacity for s in on.seeds if s.capacity}
        b = {s.seed: s.capacity for s in off.seeds if s.capacity}
        both = sorted(set(a) & set(b))
        ratio = ratio_interval([a[s] for s in both], [b[s] for s in both]) if both else None
        share = _share(on)
        lines.append(
            f"| {on.policy} | {on.capacity.fmt() if on.capacity else 'none passed'} "
            f"| {off.capacity.fmt() if off.capacity else 'none passed'} | {ratio.fmt() if ratio else 'n/a'} "
            f"| {', '.join(f'{s}: {a[s] / b[s]:.2f}' for s in both) or 'n/a'} "
            f"| {'n/a' if share is None else f'{share:.0%}'} |"
        )
        data[on.policy] = {
            "without": off.policy,
            "ratio": ratio.as_dict() if ratio else None,
            "per_seed": {str(s): a[s] / b[s] for s in both},
            "prompt_reused_share": share,
        }
    return lines + [""], data
