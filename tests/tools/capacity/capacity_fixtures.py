"""Hand-made capacity probes for the capacity tests: records with a chosen number of requests meeting the SLOs,
stored exactly as a real probe would be (tools.capacity.store), so analysis and report run on them unchanged."""

from __future__ import annotations

from pathlib import Path

from tools.capacity import store
from tools.capacity.slo import TARGET_ATTAINMENT, Slos, attainment
from tools.replay.client import RequestRecord
from tools.replay.result import ReplayResult

SLOS = Slos(2.0, 0.35)


def records(n: int, good: int, int4: int = 0, priorities: list[int] | None = None) -> list[RequestRecord]:
    """n requests, `good` of them within both SLOs (TTFT 0.5 s, TPOT 0.1 s), the rest with a 5 s TTFT; request i
    sent at priorities[i] (default 0)."""
    out = []
    for i in range(n):
        ttft = 0.5 if i < good else 5.0
        send = float(i)
        tokens = [send + ttft + 0.1 * k for k in range(4)]
        out.append(
            RequestRecord(
                i,
                send,
                20,
                4,
                send,
                tokens[0],
                tokens[-1],
                tokens,
                tokens,
                [int4] * 4,
                "ok",
                priority=priorities[i] if priorities else 0,
            )
        )
    return out


def put(
    root: Path,
    traffic: str,
    pool: int,
    policy: str,
    seed: int,
    rate: float,
    n: int,
    good: int,
    int4: int = 0,
    load=(1.0, 1.5),
    started="2026-12-01 00:00:00",
    batch: float = 4.0,
    repeat: int = 0,
    priorities: list[int] | None = None,
    reused_tokens: int | None = None,
) -> Path:
    """A stored probe; `reused_tokens`: the prefix-cache counter's increase over it (None: no such gauge)."""
    recs = records(n, good, int4, priorities)
    samples = [
        {
            "t": 0.5 * k,
            "active": batch + 1,
            "scheduled": batch,
            "waiting": 1,
            "kv_blocks": 32,
            "kv_used": 24,
            "kv_capacity": 16,
            "int4_layers": int4,
            "preemptions": 7 + k,
            "swaps_down": 3,
        }
        for k in range(4)
    ]
    if reused_tokens is not None:
        for k, x in enumerate(samples):
            x["prefix_reused_tokens"] = 100 + reused_tokens * k // 3
    att = attainment(recs, SLOS)
    probe = {
        "attained": att >= TARGET_ATTAINMENT,
        "attainment": att,
        "sensitivity": {"0.5": attainment(recs, SLOS.scaled(0.5)), "2": attainment(recs, SLOS.scaled(2.0))},
        "slo": {"ttft_s": SLOS.ttft_s, "tpot_s": SLOS.tpot_s, "target_attainment": TARGET_ATTAINMENT},
        "requests": n,
        "window_s": n / rate,
        "offered_req_s": rate * 10,
        "drain_s": 10.0,
        "traffic_described": f"{traffic}: fixture",
        "workload": "fixture workload",
        "started_utc": started,
        "wall_s": 1.0,
        "load_avg_1m": list(load),
        "load_avg_5m_end": 1.0,
        "cpus": 2,
        "commit": "abc1234",
        "dirty": [],
        "server_params": {"max_tokens_in_paged_kv_cache": str(pool)},
    }
    return store.save(
        root, store.ProbeKey(traffic, pool, policy, seed, rate, repeat), ReplayResult(recs, samples, [0.2]), probe
    )
