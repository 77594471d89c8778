"""The server's state over time, for the timeline: polls Triton's Prometheus endpoint every ~0.5 s.

Gauges are refreshed by the model every `metrics_interval_s`, so a sample is at most that old.
"""

from __future__ import annotations

import asyncio
import re

# Timeline field -> (metric name, required labels).
GAUGES = {
    "waiting": ("morphserve_requests", {"state": "waiting"}),
    "scheduled": ("morphserve_requests", {"state": "scheduled"}),
    "active": ("morphserve_requests", {"state": "active"}),
    "int4_layers": ("morphserve_int4_layers", {}),
    "kv_blocks": ("morphserve_kv_cache_blocks", {"type": "max"}),
    "kv_used": ("morphserve_kv_cache_blocks", {"type": "used"}),
    "kv_capacity": ("morphserve_kv_capacity_blocks", {}),
    "preemptions": ("morphserve_preemptions_total", {}),
    "swaps_down": ("morphserve_layer_swaps_total", {"direction": "down"}),
    "memory_budget": ("morphserve_memory_bytes", {"type": "budget"}),
    "memory_used": ("morphserve_memory_bytes", {"type": "used"}),
    "prefix_reused_tokens": ("morphserve_prefix_cache_reused_tokens_total", {}),
    "prefix_evicted_misses": ("morphserve_prefix_cache_evicted_miss_blocks_total", {}),
}

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        out.append((m["name"], dict(_LABEL.findall(m["labels"] or "")), value))
    return out


def snapshot(text: str, model: str | None = None) -> dict[str, float]:
    """The timeline fields found in one scrape (a missing metric is left out)."""
    out: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if model and labels.get("model", model) != model:
            continue
        for key, (want, need) in GAUGES.items():
            if name == want and all(labels.get(k) == v for k, v in need.items()):
                out[key] = value
    return out


class MetricsSampler:
    def __init__(self, url: str, clock, interval_s: float = 0.5, model: str | None = None):
        self.url, self.clock, self.interval_s, self.model = url, clock, interval_s, model
        self.samples: list[dict[str, float]] = []
        self.errors = 0

    async def run(self, stop: asyncio.Event) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not stop.is_set():
                t = self.clock.now()
                try:
                    async with session.get(self.url) as resp:
                        snap = snapshot(await resp.text(), self.model)
                    self.samples.append({"t": round(t, 3), **snap})
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    self.errors += 1  # a busy server may miss a scrape; the timeline just has a gap
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, self.interval_s - (self.clock.now() - t)))
                except asyncio.TimeoutError:
                    pass
