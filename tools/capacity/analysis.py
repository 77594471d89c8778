"""From the stored probes to the figures: each seed's capacity (the highest rate that passed below the lowest
that failed), each policy's mean capacity with its 95% interval, its ratio to `full` on the same seeds
(Fieller), the time-weighted quality loss at capacity, and the numbers that explain the regime (decode batch
reached, KV usage, prompt share of tokens) from the probe's own timeline."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tools.capacity import store
from tools.capacity.stats import Interval, mean_interval, ratio_interval
from tools.replay import metrics as rm

REFERENCE = "full"


@dataclass
class SeedCapacity:
    seed: int
    capacity: float | None  # rate scale; None: no probe passed
    failed_above: float | None  # lowest rate that failed (None: none did)
    probes: list[dict] = field(default_factory=list)  # probe blocks, by rate
    at_capacity: Path | None = None  # the raw file of the probe at capacity

    @property
    def bracket(self) -> float | None:
        """hi / lo: how tightly the search pinned the capacity."""
        return self.failed_above / self.capacity if self.capacity and self.failed_above else None


def seed_capacity(seed: int, files: list[Path]) -> SeedCapacity:
    probes = sorted(((store.load_probe(p), p) for p in files), key=lambda x: x[0]["rate"])
    failed = [pr["rate"] for pr, _ in probes if not pr["attained"]]
    ceiling = min(failed) if failed else math.inf
    passed = [(pr["rate"], p) for pr, p in probes if pr["attained"] and pr["rate"] < ceiling]
    cap, path = max(passed) if passed else (None, None)
    return SeedCapacity(seed, cap, min(failed) if failed else None, [pr for pr, _ in probes], path)


def _during(samples: list[dict], key: str) -> float:
    """A server counter's increase over the probe (the server is kept across probes: its totals are not)."""
    vals = [x[key] for x in samples if key in x]
    return vals[-1] - vals[0] if vals else math.nan


def _first(samples: list[dict], key: str) -> float:
    """A gauge's value at the probe's start (the server idle, a dynamic policy restored)."""
    return next((float(x[key]) for x in samples if key in x), math.nan)


def misses(records, slo: rm.Slo) -> dict[str, int]:
    """Why requests missed: the TTFT SLO only, the TPOT SLO only, both, or not completed at all."""
    out = {"ttft": 0, "tpot": 0, "both": 0, "incomplete": 0}
    for r in records:
        if r.status != "ok":
            out["incomplete"] += 1
            continue
        late = rm.ttft(r) is not None and rm.ttft(r) > slo.ttft_s
        slow = slo.tpot_s is not None and rm.tpot(r) is not None and rm.tpot(r) > slo.tpot_s
        if late or slow:
            out["both" if late and slow else "ttft" if late else "tpot"] += 1
    return out


def classes(records, slo: rm.Slo) -> dict[str, dict]:
    """Per priority class (str(priority) -> its figures), where a probe sent more than one class; else {}.
    A mixed kind's probe still passes or fails on all requests together (slo.attainment)."""
    by: dict[int, list] = defaultdict(list)
    for r in records:
        by[getattr(r, "priority", 0)].append(r)
    if len(by) < 2:
        return {}
    return {
        str(p): {
            "requests": len(rs),
            "attainment": sum(slo.met(r) for r in rs) / len(rs),
            "ttft_p95": rm.summarize(rs, slo).ttft.p95,
            "misses": misses(rs, slo),
        }
        for p, rs in sorted(by.items())
    }


def probe_numbers(path: Path, quality: dict[int, float] | None) -> dict:
    """What one probe's run shows: attainment, latencies, the decode batch, KV use, INT4 layers, quality."""
    probe, res = store.load_result(path)
    block_size = int(probe.get("server_params", {}).get("block_size", 16))
    slo = rm.Slo(probe["slo"]["ttft_s"], probe["slo"]["tpot_s"])
    s = rm.summarize(res.records, slo)
    busy = [x for x in res.samples if x.get("active")]
    col = lambda key: np.array([x[key] for x in busy if key in x], dtype=float)  # noqa: E731
    batch, used, blocks = col("scheduled"), col("kv_used"), col("kv_blocks")  # scheduled: in the running batch
    cap = max((x.get("kv_capacity", 0) for x in res.samples), default=0)
    usage = used / np.maximum(blocks, 1) if used.size == blocks.size and used.size else np.array([])
    ok = [r for r in res.records if r.status == "ok"]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(len(r.token_s) for r in ok)
    ppl = rm.weighted_perplexity(res.records, quality) if quality else math.nan
    sent_prompt = sum(r.prompt_tokens for r in res.records)
    reused = _during(res.samples, "prefix_reused_tokens")  # nan where the probe predates the gauge
    return {
        "rate": probe["rate"],
        "attainment": probe["attainment"],
        "sensitivity": probe.get("sensitivity", {}),
        "requests": probe["requests"],
        "offered_req_s": probe["offered_req_s"],
        "violation_rate": s.slo_violation_rate,
        "misses": misses(res.records, slo),
        "ttft_p50": s.ttft.p50,
        "ttft_p95": s.ttft.p95,
        "tpot_p50": s.tpot.p50,
        "tpot_p95": s.tpot.p95,
        "decode_batch_mean": float(batch.mean()) if batch.size else math.nan,
        "decode_batch_max": float(batch.max()) if batch.size else math.nan,
        "waiting_mean": float(col("waiting").mean()) if busy and col("waiting").size else math.nan,
        "kv_usage_mean": float(usage.mean()) if usage.size else math.nan,
        "kv_peak_x": float(blocks.max() / cap) if blocks.size and cap else math.nan,
        # Equal memory: the budget every policy of a cell holds, and the KV it turned into (tokens).
        "memory_budget_bytes": _first(res.samples, "memory_budget"),
        "kv_tokens_start": _first(res.samples, "kv_blocks") * block_size,
        "kv_tokens_peak": max((x["kv_blocks"] for x in res.samples if "kv_blocks" in x), default=math.nan) * block_size,
        "preemptions": _during(res.samples, "preemptions"),
        "layer_swaps_down": _during(res.samples, "swaps_down"),
        "int4_layers_mean": s.mean_int4_layers,
        "prompt_token_share": prompt / (prompt + out) if ok else math.nan,
        "quality_loss": rm.quality_loss(ppl, quality) if quality and not math.isnan(ppl) else math.nan,
        "load_avg_1m": probe["load_avg_1m"],
        "started_utc": probe["started_utc"],
        "commit": probe["commit"],
        "dirty": probe.get("dirty", []),
        "unloaded_ttft_s": res.unloaded_ttft_s,
        "prefix_reused_tokens": reused,
        "prefix_reused_share": reused / sent_prompt if sent_prompt else math.nan,
        "classes": classes(res.records, slo),
    }


@dataclass
class PolicyResult:
    policy: str
    seeds: list[SeedCapacity]
    capacity: Interval | None  # rate scale, over seeds with a capacity
    req_s: Interval | None  # the offered req/s at each seed's capacity
    ratio: Interval | None  # to REFERENCE, paired by seed
    at_capacity: list[dict]  # probe_numbers of each seed's capacity probe
    quality_loss: Interval | None

    def as_dict(self) -> dict:
        d = lambda i: i.as_dict() if i else None  # noqa: E731
        return {
            "capacity_rate_scale": d(self.capacity),
            "capacity_req_s": d(self.req_s),
            "ratio_to_full": d(self.ratio),
            "quality_loss": d(self.quality_loss),
            "per_seed": [
                {
                    "seed": s.seed,
                    "capacity_rate_scale": s.capacity,
                    "failed_above": s.failed_above,
                    "probes": len(s.probes),
                }
                for s in self.seeds
            ],
        }


def analyse(root: Path, quality: dict[int, float] | None) -> dict[tuple[str, int], dict[str, PolicyResult]]:
    """(traffic, pool) -> policy -> its result."""
    groups: dict[tuple, list[Path]] = defaultdict(list)
    for path in store.stored(root):
        p = store.load_probe(path)
        groups[(p["traffic"], p["pool"], p["policy"], p["seed"])].append(path)
    by_cell: dict[tuple[str, int], dict[str, list[SeedCapacity]]] = defaultdict(lambda: defaultdict(list))
    for (traffic, pool, policy, seed), files in sorted(groups.items()):
        by_cell[(traffic, pool)][policy].append(seed_capacity(seed, files))
    out = {}
    for cell, policies in by_cell.items():
        ref = {s.seed: s.capacity for s in policies.get(REFERENCE, []) if s.capacity}
        out[cell] = {}
        for policy, seeds in policies.items():
            have = [s for s in seeds if s.capacity]
            nums = [probe_numbers(s.at_capacity, quality) for s in have]
            paired = [s for s in have if s.seed in ref]
            losses = [n["quality_loss"] for n in nums if not math.isnan(n["quality_loss"])]
            out[cell][policy] = PolicyResult(
                policy,
                seeds,
                mean_interval([s.capacity for s in have]) if have else None,
                mean_interval([n["offered_req_s"] for n in nums]) if nums else None,
                ratio_interval([s.capacity for s in paired], [ref[s.seed] for s in paired]) if paired else None,
                nums,
                mean_interval(losses) if losses else None,
            )
    return out


def same_rate(root: Path, traffic: str, pool: int, quality: dict[int, float] | None) -> list[tuple[int, float, dict]]:
    """(seed, rate, policy -> probe_numbers) for every seed and rate that two or more policies probed: the direct
    comparison at equal load (the probes ran back to back), with or without `full` among them."""
    by: dict[tuple[int, float], dict[str, Path]] = defaultdict(dict)
    for path in store.stored(root):
        p = store.load_probe(path)
        if p["traffic"] == traffic and p["pool"] == pool:
            by[(p["seed"], p["rate"])][p["policy"]] = path
    return [
        (seed, rate, {pol: probe_numbers(path, quality) for pol, path in paths.items()})
        for (seed, rate), paths in sorted(by.items())
        if len(paths) > 1
    ]


@dataclass
class RepeatedProbe:
    """One (policy, seed, rate) run more than once: the search's probe first, then its repeats."""

    policy: str
    seed: int
    rate: float
    attainments: list[float]
    verdicts: list[bool]

    @property
    def spread(self) -> float:
        """max - min attainment: how far one probe moves with nothing changed but the moment it ran."""
        return max(self.attainments) - min(self.attainments)

    @property
    def verdicts_agree(self) -> bool:
        return len(set(self.verdicts)) == 1

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "seed": self.seed,
            "rate_scale": self.rate,
            "attainments": self.attainments,
            "verdicts": self.verdicts,
            "spread": self.spread,
            "verdicts_agree": self.verdicts_agree,
        }


def within_seed_noise(root: Path, traffic: str, pool: int) -> list[RepeatedProbe]:
    """Every probe of this cell that was repeated (plan.repeat_nearest), with the search's own run first."""
    runs: dict[tuple[str, int, float], list[dict]] = defaultdict(list)
    for path in store.stored(root) + store.repeats(root):  # the search's probe first, then repeats in order
        p = store.load_probe(path)
        if p["traffic"] == traffic and p["pool"] == pool:
            runs[(p["policy"], p["seed"], p["rate"])].append(p)
    out = []
    for (policy, seed, rate), probes in sorted(runs.items()):
        if len(probes) > 1:
            probes.sort(key=lambda p: p.get("repeat", 0))
            out.append(
                RepeatedProbe(
                    policy, seed, rate, [p["attainment"] for p in probes], [bool(p["attained"]) for p in probes]
                )
            )
    return out
