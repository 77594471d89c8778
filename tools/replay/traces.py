"""Arrival traces for the replay benchmark: read, window, scale, or synthesize.

A trace is a list of `TraceRequest` (arrival seconds from the start of the window, prompt and output
lengths in tokens). Real traces come from the Azure LLM inference CSVs (TIMESTAMP, ContextTokens,
GeneratedTokens) or Mooncake-style JSONL (timestamp in ms, input_length, output_length). Their lengths and
rates are far beyond a 135M model on two CPU cores, so `Shaping` keeps the arrival pattern and scales the
rest explicitly; `Shaping.describe()` says what was done, and every tool prints it.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path


@dataclass(slots=True, frozen=True, order=True)
class TraceRequest:
    arrival_s: float  # from the start of the window (after time scaling)
    prompt_tokens: int
    output_tokens: int


# --- readers -------------------------------------------------------------------------------------------------
def _azure_time(text: str) -> datetime:
    # NOTE: the Azure CSVs carry 7 fractional digits; fromisoformat takes at most 6.
    head, dot, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{frac[:6]}" if dot else head)


def read_azure_csv(path: str | Path) -> list[TraceRequest]:
    with open(path, newline="") as f:
        rows = [
            (_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)
        ]
    if not rows:
        return []
    t0 = min(t for t, _, _ in rows)
    return sorted(TraceRequest((t - t0).total_seconds(), p, o) for t, p, o in rows)


def read_mooncake_jsonl(path: str | Path, time_unit_s: float = 1e-3) -> list[TraceRequest]:
    """Mooncake traces give `timestamp` in milliseconds (time_unit_s=1e-3); other fields are ignored."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append((float(r["timestamp"]) * time_unit_s, int(r["input_length"]), int(r["output_length"])))
    if not out:
        return []
    t0 = min(t for t, _, _ in out)
    return sorted(TraceRequest(t - t0, p, o) for t, p, o in out)


def read_trace(path: str | Path, fmt: str = "auto", jsonl_time_unit_s: float = 1e-3) -> list[TraceRequest]:
    fmt = fmt if fmt != "auto" else ("jsonl" if str(path).endswith((".jsonl", ".json")) else "azure")
    if fmt == "azure":
        return read_azure_csv(path)
    if fmt == "jsonl":
        return read_mooncake_jsonl(path, jsonl_time_unit_s)
    raise ValueError(f"unknown trace format {fmt!r} (auto, azure, jsonl)")


# --- shaping -------------------------------------------------------------------------------------------------
def _clip(lo: int, hi: int | None, value: int) -> int:
    return max(lo, min(hi, value) if hi is not None else value)


@dataclass(slots=True)
class Shaping:
    """Window -> rate scale -> time scale -> length scale and clipping, in that order."""

    window_start_s: float = 0.0
    window_s: float | None = None  # None: to the end of the trace
    rate_scale: float = 1.0  # <1 thins, >1 replicates arrivals; the window keeps its duration
    time_scale: float = 1.0  # >1 plays the window faster (compresses time; multiplies the rate too)
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    prompt_clip: tuple[int, int | None] = (1, None)
    output_clip: tuple[int, int | None] = (1, None)
    seed: int = 0
    notes: list[str] = field(default_factory=list)  # filled by apply(): what came in, what went out

    def __post_init__(self):
        if self.rate_scale <= 0 or self.time_scale <= 0:
            raise ValueError("rate_scale and time_scale must be > 0")
        if self.prompt_scale <= 0 or self.output_scale <= 0:
            raise ValueError("prompt_scale and output_scale must be > 0")
        if self.window_s is not None and self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        for name in ("prompt_clip", "output_clip"):
            lo, hi = getattr(self, name)
            if lo < 1 or (hi is not None and hi < lo):
                raise ValueError(f"{name} must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")

    @property
    def duration_s(self) -> float | None:
        return None if self.window_s is None else self.window_s / self.time_scale

    def apply(self, trace: list[TraceRequest]) -> list[TraceRequest]:
        end = math.inf if self.window_s is None else self.window_start_s + self.window_s
        window = [r for r in trace if self.window_start_s <= r.arrival_s < end]
        rng = random.Random(self.seed)
        out: list[TraceRequest] = []
        for r in window:
            # NOTE: one uniform draw per request decides its copies, so the requests kept at a lower rate
            # scale are a subset of those kept at a higher one (a sweep stays comparable).
            u = rng.random()
            copies = int(self.rate_scale) + (u < self.rate_scale - int(self.rate_scale))
            for c in range(copies):
                # Replicas land within the next second, not on the same instant.
                t = r.arrival_s - self.window_start_s + (rng.random() if c else 0.0)
                out.append(
                    TraceRequest(
                        t / self.time_scale,
                        _clip(*self.prompt_clip, round(r.prompt_tokens * self.prompt_scale)),
                        _clip(*self.output_clip, round(r.output_tokens * self.output_scale)),
                    )
                )
        out.sort(key=lambda r: r.arrival_s)
        self.notes = [
            describe_lengths("trace window", window, self.window_s),
            describe_lengths("replayed", out, self.duration_s),
        ]
        return out

    def describe(self) -> str:
        window = (
            f"[{self.window_start_s:g} s, {self.window_start_s + self.window_s:g} s)"
            if self.window_s
            else f"[{self.window_start_s:g} s, end)"
        )
        clip = lambda c: f"{c[0]}:{c[1] if c[1] is not None else 'inf'}"  # noqa: E731
        lines = [
            f"window {window} of the trace; rate x{self.rate_scale:g} (thin/replicate, seed {self.seed}), "
            f"time x{self.time_scale:g} (effective arrival rate x{self.rate_scale * self.time_scale:g}); "
            f"prompt tokens x{self.prompt_scale:g} clipped to {clip(self.prompt_clip)}, "
            f"output tokens x{self.output_scale:g} clipped to {clip(self.output_clip)}"
        ]
        return "\n".join(lines + self.notes)

    def as_dict(self) -> dict:
        return asdict(self)


def describe_lengths(label: str, reqs: list[TraceRequest], duration_s: float | None) -> str:
    if not reqs:
        return f"{label}: no requests"
    p = sorted(r.prompt_tokens for r in reqs)
    o = sorted(r.output_tokens for r in reqs)
    span = duration_s or (reqs[-1].arrival_s - reqs[0].arrival_s) or 1.0
    return (
        f"{label}: {len(reqs)} requests in {span:g} s ({len(reqs) / span:.3g} req/s); prompt median "
        f"{p[len(p) // 2]} max {p[-1]}, output median {o[len(o) // 2]} max {o[-1]} tokens"
    )


def parse_clip(text: str) -> tuple[int, int | None]:
    """'MIN:MAX', 'MIN:' or ':MAX' -> (min, max or None)."""
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(f"expected MIN:MAX, got {text!r}")
    return (int(lo) if lo else 1, int(hi) if hi else None)


# --- synthetic arrivals --------------------------------------------------------------------------------------
@dataclass(slots=True)
class Synthetic:
    """Open-loop arrivals without a trace. kind: poisson (rate), gamma (rate, burstiness: the gamma shape,
    below 1 is burstier, 1 is Poisson, as in vLLM's benchmark), step (Poisson at `rate`, at `burst_rate`
    for `burst_s` at the start of every `period_s`)."""

    kind: str = "poisson"
    rate: float = 1.0
    duration_s: float = 60.0
    burstiness: float = 1.0
    burst_rate: float = 0.0
    burst_s: float = 10.0
    period_s: float = 60.0
    prompt_tokens: int = 256
    output_tokens: int = 32
    length_jitter: float = 0.0  # lengths uniform in [(1-j) L, (1+j) L]
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("poisson", "gamma", "step"):
            raise ValueError(f"unknown arrival kind {self.kind!r} (poisson, gamma, step)")
        if self.rate < 0 or self.burst_rate < 0 or self.duration_s <= 0 or self.burstiness <= 0:
            raise ValueError("rates must be >= 0, duration and burstiness > 0")
        if self.kind == "step" and not 0 < self.burst_s <= self.period_s:
            raise ValueError("step arrivals need 0 < burst_s <= period_s")
        if not 0 <= self.length_jitter < 1:
            raise ValueError("length_jitter must be in [0, 1)")

    def rate_at(self, t: float) -> float:
        if self.kind == "step" and (t % self.period_s) < self.burst_s:
            return self.burst_rate
        return self.rate

    def generate(self) -> list[TraceRequest]:
        rng = random.Random(self.seed)
        out, t = [], 0.0
        shape = self.burstiness if self.kind == "gamma" else 1.0
        while True:
            rate = self.rate_at(t)
            edge = self._next_edge(t) if self.kind == "step" else math.inf
            gap = rng.gammavariate(shape, 1.0 / (rate * shape)) if rate > 0 else math.inf
            if t + gap >= edge:  # Poisson is memoryless: restart the draw at the phase edge
                t = edge
                if t >= self.duration_s:
                    return out
                continue
            t += gap
            if t >= self.duration_s:
                return out
            out.append(TraceRequest(t, self._length(rng, self.prompt_tokens), self._length(rng, self.output_tokens)))

    def _next_edge(self, t: float) -> float:
        start = t // self.period_s * self.period_s
        return start + self.burst_s if t - start < self.burst_s else start + self.period_s

    def _length(self, rng: random.Random, n: int) -> int:
        j = self.length_jitter
        return max(1, round(n * rng.uniform(1 - j, 1 + j))) if j else n

    def describe(self) -> str:
        what = {
            "poisson": f"Poisson {self.rate:g} req/s",
            "gamma": f"gamma {self.rate:g} req/s, burstiness {self.burstiness:g}",
            "step": f"step {self.rate:g} req/s, {self.burst_rate:g} req/s for {self.burst_s:g} s every {self.period_s:g} s",
        }
        return (
            f"synthetic arrivals: {what[self.kind]} for {self.duration_s:g} s (seed {self.seed}); prompt "
            f"{self.prompt_tokens} output {self.output_tokens} tokens, jitter +-{self.length_jitter:.0%}"
        )
