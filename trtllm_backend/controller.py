"""When to morph: policies and the controller that turns per-iteration signals into actions.

Three pressures swap down: a KV shortage (always), and two kinds of slowness, each only where the morph manager
measured the next unit's quantized form faster than its full one at the current decode batch: decode time (TPOT
above `down_tpot_s` with requests waiting) and queueing (the head of the queue waiting longer than `down_ttft_s`
though the KV cache is not short: the engine's compute, not its memory, is the limit, and faster layers serve
more). A dynamic policy takes `down_tpot_s` from the deployment's TPOT SLO (`tpot_slo_s`, TPOT_PRESSURE_SHARE of
it), and the QUEUEING_MODES take `down_ttft_s` from its TTFT SLO (`ttft_slo_s`, TTFT_PRESSURE_SHARE of it),
unless they are set themselves.

A fourth, off unless `down_cache_miss_s` is set: prefill spent on prompt blocks the prefix cache had held and
evicted (timed at the engine's measured cost of a token). It is memory a bigger pool would turn into time: a swap
down keeps more conversations cached between their turns. Its restore waits `up_cache_quiet_s` after the last
such miss, since a shrink evicts what the next turn would reuse.

A swap down takes enough units to admit the waiting queue, and at least the policy's step; the step grows
(`down_step_growth`) while swaps follow each other without a quiet spell, so a burst that outgrows one swap gets
a bigger next one rather than one step per wait for pressure.

Hysteresis keeps it from oscillating: pressure must persist for `down_persist` iterations before a swap,
and the load must stay low for `up_quiet_s` seconds (measured from the last sign of pressure or the end of
the last action, `hold`) before a restore; with the TPOT pressure on, a restore also waits for TPOT at or below
`up_tpot_ratio * down_tpot_s`. Restores undo the most recent swap first.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace


# The morph policy names, shared by the controller and the Triton parameter validation. Besides these, the
# static form `int4:N` quantizes N layers (swap order) at load and keeps them so. `q4_1` binds every decoder layer
# to its Q4_1 fragment at load (a GGUF's own 4-bit blocks: lossless against full where full is that GGUF
# dequantized, engines/gguf_q4_1.py) and never morphs.
POLICY_NAMES = ("accuracy", "balanced", "performance", "full", "int4", "q4_1")
STATIC_INT4_FORM = re.compile(r"int4:(\d+)")
# Decode slower than this share of the TPOT SLO, with requests waiting, is pressure: the margin lets a swap
# land (staging, a few iterations) before the P95 crosses the SLO (docs/architecture.md, "Why the thresholds").
TPOT_PRESSURE_SHARE = 0.85
# The head of the queue waiting longer than this share of the TTFT SLO is pressure (where a swap is faster): the
# rest is left for the swaps to take effect and the queue to drain.
TTFT_PRESSURE_SHARE = 0.25
# The modes that take the queueing pressure from the TTFT SLO by default: it buys capacity with quality, so only
# the mode that puts capacity first has it on; the others take it from morph_down_ttft_s.
QUEUEING_MODES = ("performance",)


def is_policy_spec(spec: str) -> bool:
    """Syntax only (a name or int4:N); `parse_policy` also checks N against the model."""
    spec = spec.strip().lower()
    return spec in POLICY_NAMES or STATIC_INT4_FORM.fullmatch(spec) is not None


@dataclass(slots=True)
class MorphPolicy:
    name: str = "balanced"
    dynamic: bool = True
    static_int4_layers: int = 0  # static policies: layers quantized at load and kept so
    # The precision a layer is bound to when it is not swapped down (Precision values): full, or q4_1 (policy q4_1).
    base_precision: str = "full"
    layers_per_action: int = 2
    # Each swap down that follows the last action without a quiet spell between them takes this many times the
    # step before it (1: every step is layers_per_action): a burst that outgrows one swap gets the next one bigger.
    down_step_growth: float = 2.0
    max_int4_layers: int = 20
    down_kv_usage: float = 0.90  # KV usage that, with requests waiting, means the KV cache is short
    down_queue_wait_s: float = 0.5  # how long the head of the queue must wait for KV blocks to count as pressure
    down_persist: int = 2  # consecutive pressured iterations before swapping down
    up_kv_usage: float = 0.50  # restore only if usage stays below this after the shrink
    up_quiet_s: float = 2.0  # seconds without pressure before restoring
    down_tpot_s: float = 0.0  # streams' recent TPOT above this with requests waiting is pressure (0: off)
    up_tpot_ratio: float = 0.7  # with down_tpot_s set, restore only while TPOT <= this fraction of it
    down_ttft_s: float = 0.0  # the head of the queue waiting longer than this, KV not short, is pressure (0: off)
    down_cache_miss_s: float = 0.0  # prefill seconds on evicted prefix blocks that are pressure (0: off)
    up_cache_quiet_s: float = 30.0  # with down_cache_miss_s set: seconds without such a miss before restoring

    TUNABLE = (
        "layers_per_action",
        "down_step_growth",
        "max_int4_layers",
        "down_kv_usage",
        "down_queue_wait_s",
        "down_persist",
        "up_kv_usage",
        "up_quiet_s",
        "down_tpot_s",
        "up_tpot_ratio",
        "down_ttft_s",
        "down_cache_miss_s",
        "up_cache_quiet_s",
    )

    @property
    def slowness_counts(self) -> bool:
        """Decode time or queueing can be pressure (then the morph manager measures whether a swap is faster)."""
        return bool(self.down_tpot_s or self.down_ttft_s)

    def validate(self, num_layers: int) -> None:
        def bad(name, why):
            raise ValueError(f"morph_{name}: {why}" if name != "policy" else f"morph_policy: {why}")

        if not 0 <= self.static_int4_layers <= num_layers:
            bad("policy", f"int4:N needs 0 <= N <= {num_layers}, got {self.static_int4_layers}")
        if self.layers_per_action < 1:
            bad("layers_per_action", "must be >= 1")
        if not (math.isfinite(self.down_step_growth) and self.down_step_growth >= 1.0):
            bad("down_step_growth", "must be >= 1 (1: every swap down takes morph_layers_per_action)")
        if not 0 <= self.max_int4_layers <= num_layers:
            bad("max_int4_layers", f"must be in [0, {num_layers}]")
        for name in ("down_kv_usage", "up_kv_usage"):
            if not 0.0 < getattr(self, name) <= 1.0:
                bad(name, "must be in (0, 1]")
        if self.up_kv_usage >= self.down_kv_usage:
            bad("up_kv_usage", "must be below morph_down_kv_usage (hysteresis)")
        if self.down_persist < 1:
            bad("down_persist", "must be >= 1")
        if self.down_queue_wait_s < 0 or self.up_quiet_s < 0:
            bad("up_quiet_s" if self.up_quiet_s < 0 else "down_queue_wait_s", "must be >= 0")
        if self.down_tpot_s < 0:
            bad("down_tpot_s", "must be >= 0 (0 turns the decode-time pressure off)")
        if self.down_ttft_s < 0:
            bad("down_ttft_s", "must be >= 0 (0 turns the queueing pressure off)")
        if not 0.0 < self.up_tpot_ratio < 1.0:
            bad("up_tpot_ratio", "must be in (0, 1) (hysteresis)")
        if self.down_cache_miss_s < 0:
            bad("down_cache_miss_s", "must be >= 0 (0 turns the cache pressure off)")
        if self.up_cache_quiet_s < 0:
            bad("up_cache_quiet_s", "must be >= 0")


def _modes(num_layers: int) -> dict[str, MorphPolicy]:
    return {
        # accuracy: few layers, late and slowly; performance: many layers, early and fast.
        "accuracy": MorphPolicy(
            "accuracy",
            layers_per_action=1,
            down_step_growth=1.0,
            max_int4_layers=num_layers // 3,
            down_persist=4,
            down_queue_wait_s=1.0,
            up_quiet_s=1.0,
        ),
        "balanced": MorphPolicy("balanced", layers_per_action=2, max_int4_layers=(2 * num_layers) // 3),
        "performance": MorphPolicy(
            "performance",
            layers_per_action=4,
            max_int4_layers=num_layers,
            down_persist=1,
            down_queue_wait_s=0.2,
            up_quiet_s=4.0,
        ),
    }


def parse_policy(
    spec: str, num_layers: int, overrides: dict | None = None, tpot_slo_s: float = 0.0, ttft_slo_s: float = 0.0
) -> MorphPolicy:
    """One of POLICY_NAMES or `int4:N`, plus optional threshold overrides. `num_layers` counts the swappable
    units: the decoder layers, plus the tied embedding / LM head where the fragment set has its INT8 fragment
    (then "int4" and `int4:N` take the head too at its place in the swap order, and the limits count it).
    `tpot_slo_s` / `ttft_slo_s` (0: none) set a dynamic policy's decode-time / queueing pressure unless `overrides`
    sets down_tpot_s / down_ttft_s."""
    for name, slo, what in (("tpot_slo_s", tpot_slo_s, "decode-time"), ("ttft_slo_s", ttft_slo_s, "queueing")):
        if slo < 0 or not math.isfinite(slo):
            raise ValueError(f"{name}: must be >= 0 (0: no SLO, no {what} pressure), got {slo!r}")
    spec = (spec or "").strip().lower()
    modes = _modes(num_layers)
    if spec in modes:
        policy = modes[spec]
    elif spec == "full":
        policy = MorphPolicy("full", dynamic=False, max_int4_layers=0)
    elif spec == "q4_1":
        policy = MorphPolicy("q4_1", dynamic=False, max_int4_layers=0, base_precision="q4_1")
    elif spec == "int4":
        policy = MorphPolicy("int4", dynamic=False, static_int4_layers=num_layers, max_int4_layers=num_layers)
    elif spec.startswith("int4:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"morph_policy: int4:N needs an integer N, got {spec!r}") from None
        policy = MorphPolicy(spec, dynamic=False, static_int4_layers=n, max_int4_layers=max(0, min(n, num_layers)))
    else:
        raise ValueError(f"morph_policy: unknown policy {spec!r} ({', '.join(POLICY_NAMES)}, int4:N)")
    if policy.dynamic:
        queueing = TTFT_PRESSURE_SHARE * ttft_slo_s if policy.name in QUEUEING_MODES else 0.0
        policy = replace(policy, down_tpot_s=TPOT_PRESSURE_SHARE * tpot_slo_s, down_ttft_s=queueing)
    if overrides:
        known = {f.name: f.type for f in fields(MorphPolicy)}
        for key, value in overrides.items():
            if key not in MorphPolicy.TUNABLE:
                raise ValueError(f"morph_{key}: unknown morph threshold (known: {', '.join(MorphPolicy.TUNABLE)})")
            cast = int if known[key] in ("int", int) else float
            try:
                policy = replace(policy, **{key: cast(value)})
            except (TypeError, ValueError):
                raise ValueError(f"morph_{key}: expected {cast.__name__}, got {value!r}") from None
    policy.validate(num_layers)
    return policy


@dataclass(slots=True)
class Load:
    """The serving load of one iteration, taken by the engine from its scheduler, KV pool and running streams
    (only the classes within morph_priority_cutoff count) and handed to the morph manager, which reads it (never
    changes it) and adds its own state to make the controller's `Signals`. Not frozen: built every iteration, and a
    frozen dataclass costs several times more to build."""

    now: float
    waiting: int
    head_wait_s: float = 0.0
    kv_usage: float = 0.0  # blocks held, and promised to running requests (scheduler.reserved_blocks), over all
    kv_reserved_blocks: int = 0  # blocks promised to running requests beyond those they hold
    admission_blocked: bool = False
    new_preemptions: int = 0
    queue_blocks_short: int = 0  # blocks the waiting queue lacks to be admitted (scheduler.queue_blocks_short)
    tpot_s: float = 0.0  # running streams' recent TPOT (request.streams_tpot; 0 with none decoding)
    batch: int = 0  # running requests: the decode batch a swap's speed is judged at
    evicted_miss_s: float = 0.0  # prefill time of prompt blocks the prefix cache had evicted, since the last tick


@dataclass(slots=True)
class Signals:
    """What the controller decides on: an iteration's `Load` and the morph manager's state (MorphManager.signals)."""

    now: float
    waiting: int
    head_wait_s: float
    kv_usage: float
    admission_blocked: bool
    new_preemptions: int
    queue_blocks_short: int  # blocks the waiting queue lacks to be admitted (0 if none waits)
    blocks_per_layer: int  # KV blocks one swapped layer buys
    int4_layers: int  # units swapped down: INT4 layers, plus the INT8 LM head when swapped
    usage_after_shrink: float  # KV usage if the most recent swap's blocks were gone (1.0 if not possible)
    tpot_s: float = 0.0  # running streams' recent TPOT (request.streams_tpot; 0 with none decoding)
    swap_speeds_up: bool = False  # the next unit's quantized form was measured faster at the current decode batch
    evicted_miss_s: float = 0.0  # prefill time of evicted prefix blocks since the last decision (Load's, summed)

    @classmethod
    def of(
        cls,
        load: Load,
        *,
        blocks_per_layer: int,
        int4_layers: int,
        usage_after_shrink: float,
        swap_speeds_up: bool = False,
    ) -> "Signals":
        return cls(
            now=load.now,
            waiting=load.waiting,
            head_wait_s=load.head_wait_s,
            kv_usage=load.kv_usage,
            admission_blocked=load.admission_blocked,
            new_preemptions=load.new_preemptions,
            queue_blocks_short=load.queue_blocks_short,
            blocks_per_layer=blocks_per_layer,
            int4_layers=int4_layers,
            usage_after_shrink=usage_after_shrink,
            tpot_s=load.tpot_s,
            swap_speeds_up=swap_speeds_up,
            evicted_miss_s=load.evicted_miss_s,
        )


@dataclass(slots=True)
class Action:
    kind: str  # "down" or "up"
    layers: int
    reason: str
    forced: bool = False  # from parse_forced (benchmarks, tests): carried out whatever the load


@dataclass
class Controller:
    policy: MorphPolicy
    pressure_streak: int = 0
    last_pressure: float = field(default=-math.inf)
    last_action: float = field(default=-math.inf)
    last_cache_pressure: float = field(default=-math.inf)
    last_down_step: int = 0  # the step of the last swap down, while no quiet spell or restore has followed it
    forced: dict[int, Action] = field(default_factory=dict)  # engine iteration -> action (parse_forced)

    def forced_due(self, iteration: int) -> bool:
        return any(i <= iteration for i in self.forced)

    def decide(self, s: Signals, iteration: int) -> Action | None:
        due = [i for i in self.forced if i <= iteration]  # a forced action waits out an action in flight
        if due:
            return self.forced.pop(min(due))
        if not self.policy.dynamic:
            return None
        p = self.policy
        why = self.pressure(s)
        if why:
            self.pressure_streak += 1
            self.last_pressure = s.now
        else:
            self.pressure_streak = 0
        cache = self.cache_pressed(s)
        if cache:
            self.last_cache_pressure = s.now
        # NOTE: a head that waited past down_ttft_s has been pressure for that long already: no streak on top
        # (at pool 2048, waiting two more iterations per action let the queue outgrow the swaps: 35% vs 88%).
        # A cache miss is an event, already paid for: no streak either.
        persisted = self.pressure_streak >= p.down_persist or self.queueing(s) or cache
        if why and persisted and s.int4_layers < p.max_int4_layers:
            # Enough layers to admit the waiting queue, at least the step, which grows while swaps follow each
            # other without a quiet spell.
            need = math.ceil(s.queue_blocks_short / s.blocks_per_layer) if s.blocks_per_layer else 0
            step = p.layers_per_action
            if self.last_down_step and s.now - self.last_action < p.up_quiet_s:
                step = max(step, math.ceil(self.last_down_step * p.down_step_growth))
            k = min(max(step, need), p.max_int4_layers - s.int4_layers)
            self.pressure_streak = 0
            self.last_action = s.now
            self.last_down_step = k
            return Action("down", k, "; ".join(why))
        quiet = s.now - max(self.last_pressure, self.last_action)
        if (
            not why
            and s.int4_layers > 0
            and s.waiting == 0
            and quiet >= p.up_quiet_s
            and (not p.down_cache_miss_s or s.now - self.last_cache_pressure >= p.up_cache_quiet_s)
            and s.usage_after_shrink <= p.up_kv_usage
            and (not p.down_tpot_s or s.tpot_s <= p.up_tpot_ratio * p.down_tpot_s)
        ):
            self.last_action = s.now
            self.last_down_step = 0
            return Action(
                "up",
                min(p.layers_per_action, s.int4_layers),
                f"quiet {quiet:.1f}s, KV usage after shrink {s.usage_after_shrink:.0%}",
            )
        return None

    def hold(self, s: Signals) -> None:
        """An iteration with an action in flight (staging, draining): the manager decides nothing then, but the
        quiet spell a restore waits for restarts at the action's end, and pressure seen meanwhile counts.
        Why: staging the fp16 LM head takes 0.3-1.6 s on a busy core; counted from the decision, a restore could
        follow a swap down the moment it landed, mid-burst (pool 256, conversation trace, 4aa09d0)."""
        self.last_action = s.now
        if self.policy.dynamic and self.pressure(s):
            self.last_pressure = s.now
        if self.policy.dynamic and self.cache_pressed(s):
            self.last_cache_pressure = s.now

    def restore_called_off(self, now: float) -> None:
        """A restore gave way to returning pressure (morph.py): the next one waits for a new quiet spell from `now`."""
        self.last_pressure = now

    def kv_short(self, s: Signals) -> bool:
        """Requests wait and the KV cache is what they wait for (admission blocked, or usage past the threshold)."""
        return bool(s.waiting and (s.admission_blocked or s.kv_usage >= self.policy.down_kv_usage))

    def cache_pressed(self, s: Signals) -> bool:
        """Prefill spent on prompt blocks the prefix cache had evicted reached down_cache_miss_s."""
        return bool(self.policy.down_cache_miss_s and s.evicted_miss_s >= self.policy.down_cache_miss_s)

    def queueing(self, s: Signals) -> bool:
        """The head of the queue waited past down_ttft_s with the KV cache not short, and a swap is faster."""
        p = self.policy
        return bool(
            p.down_ttft_s and s.waiting and not self.kv_short(s) and s.head_wait_s > p.down_ttft_s and s.swap_speeds_up
        )

    def pressure(self, s: Signals) -> list[str]:
        """Why these signals call for swapping down (empty: no pressure). No state changes: the manager also asks
        it while a restore drains KV (a restore gives way to returning pressure, morph.py)."""
        p = self.policy
        why = []
        if self.kv_short(s) and s.head_wait_s >= p.down_queue_wait_s:
            why.append(
                f"head of queue waited {s.head_wait_s:.2f}s for KV blocks ({s.waiting} waiting, KV usage {s.kv_usage:.0%})"
            )
        if s.new_preemptions:
            why.append(f"{s.new_preemptions} preemption(s)")
        # NOTE: slowness counts only where a swap was measured to make a step faster on this machine. Where it
        # does not (INT4 no faster than full), a queue waiting on slow iterations is not helped by quantizing, and
        # reacting to it made the server swap down and up on every arrival.
        if p.down_tpot_s and s.waiting and s.tpot_s > p.down_tpot_s and s.swap_speeds_up:
            why.append(
                f"TPOT {s.tpot_s * 1e3:.1f} ms above the SLO {p.down_tpot_s * 1e3:.1f} ms with {s.waiting} "
                f"waiting (the next swap measured faster)"
            )
        if self.cache_pressed(s):
            why.append(
                f"{s.evicted_miss_s:.2f}s of prefill on prompt blocks the prefix cache had evicted (over "
                f"{p.down_cache_miss_s:.2f}s): a bigger pool keeps them"
            )
        if self.queueing(s):
            why.append(
                f"head of queue waited {s.head_wait_s:.2f}s (over {p.down_ttft_s:.2f}s) with the KV cache not "
                f"short ({s.waiting} waiting; the next swap measured faster)"
            )
        return why


def parse_forced(spec: str, source: str = "MORPHSERVE_FORCE_MORPH") -> dict[int, Action]:
    """ "down:2@5,up:2@40": forced actions at given engine iterations (EngineConfig.force_morph, or the
    MORPHSERVE_FORCE_MORPH test hook); `source` names the setting in errors and log reasons."""
    out: dict[int, Action] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            what, at = part.split("@")
            kind, _, n = what.partition(":")
            if kind not in ("down", "up"):
                raise ValueError
            out[int(at)] = Action(kind, int(n or 1), f"forced by {source} at iteration {at}", forced=True)
        except ValueError:
            raise ValueError(f"{source}: cannot parse {part!r} (expected down:K@ITER or up:K@ITER)") from None
    return out
