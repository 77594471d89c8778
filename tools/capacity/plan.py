"""The measurement plan: for each traffic kind and KV pool size, for each seed, one bisection per policy,
stepped in turn (a probe of every policy at the same seed back to back, so the machine's load drift hits all
alike). Servers are started only when a probe must run, one per policy, and kept for the (traffic, pool);
between probes each is left to go idle (and a dynamic one to restore its layers). Multi-turn traffic gets a fresh
server for every probe, so no probe finds the previous one's prefixes in the cache."""

from __future__ import annotations

import time
import urllib.request
from datetime import datetime, timezone
from dataclasses import dataclass, field
from pathlib import Path

from tools.capacity import store
from tools.capacity.analysis import REFERENCE
from tools.capacity.overload import MARK, overload_rate
from tools.capacity.probe import provenance, run_probe
from tools.capacity.search import Bisection, warm_grow
from tools.capacity.slo import Slos
from tools.capacity.traffic import Traffic
from tools.replay.paths import REPO_ROOT
from tools.replay.prompts import DEFAULT_CORPUS, DEFAULT_FRAGMENTS, PromptSource, load_tokenizer
from tools.replay.sampler import snapshot
from tools.replay.servers import DYNAMIC, Server, slug, wait_idle
from tools.replay.settings import DEFAULT_PARAMS

# The replay comparison's server settings, with a queue longer than any probe (a rejection is a miss anyway).
BASE_PARAMS = {**DEFAULT_PARAMS, "max_queue_size": "1024"}


# Policy variant names that set a server parameter of their own rather than a controller threshold, with the
# values each takes (None: passed as given).
VARIANT_PARAMS = {
    "lm_head": ("lm_head_precision", None),
    "prefix": ("enable_kv_cache_reuse", {"on": "true", "off": "false"}),
    "xreuse": ("kv_cache_reuse_across_morphs", {"on": "true", "off": "false"}),
    "sched": ("batch_scheduler_policy", {"no_evict": "guaranteed_no_evict", "max_util": "max_utilization"}),
}
# Parameters under which a server starts with more KV than the nominal pool (the INT8 head's freed bytes, or a
# budget of its own): the pool is then checked against what each server reports at start, not by its number.
KV_ENLARGING = {"lm_head_precision": "int8", "memory_budget_bytes": None}


def enlarges_kv(params: dict[str, str]) -> bool:
    return any(k in params and (v is None or params[k] == v) for k, v in KV_ENLARGING.items())


class ProbeServers:
    """The servers of one (traffic, pool): one per policy, started at its first probe and kept for the next ones
    unless `fresh` (then stopped and started anew for every probe). `start(policy)` gives (a context manager whose
    `__enter__` is the server handle, its block size); `ready(policy, handle, block_size)` checks a new server
    (block_size given) or waits for a kept one to go idle (None)."""

    def __init__(self, start, ready, fresh: bool = False):
        self.start, self.ready, self.fresh = start, ready, fresh
        self.open: dict[str, tuple[object, object]] = {}  # policy -> (context manager, handle)

    def get(self, policy: str):
        if policy in self.open and self.fresh:
            self._stop(policy)
        if policy in self.open:
            handle = self.open[policy][1]
            self.ready(policy, handle, None)
            return handle
        cm, block_size = self.start(policy)
        handle = cm.__enter__()
        self.open[policy] = (cm, handle)
        self.ready(policy, handle, block_size)
        return handle

    def _stop(self, policy: str) -> None:
        cm, _ = self.open.pop(policy)
        cm.__exit__(None, None, None)

    def __enter__(self) -> "ProbeServers":
        return self

    def __exit__(self, *exc) -> None:
        for policy in list(self.open):
            self._stop(policy)


def check_starting_kv(snap: dict[str, float], block_size: int, traffic: Traffic, pool: int, policy: str) -> int:
    """The KV tokens a server started with (its metrics scrape); refuses one that cannot hold the traffic's
    longest request, naming the policy and the pool (every such request would be refused: a probe of errors)."""
    tokens = int(snap.get("kv_blocks", 0)) * block_size
    if tokens < traffic.max_tokens():
        raise ValueError(
            f"{policy} at pool {pool} starts with {tokens} KV tokens: it cannot hold one {traffic.name} "
            f"request of up to {traffic.max_tokens()} tokens"
        )
    return tokens


def starting_kv(metrics_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The first scrape that reports the KV pool (the model publishes its gauges a moment after it is ready)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            snap = snapshot(resp.read().decode())
        if snap.get("kv_blocks") or time.monotonic() > deadline:
            return snap
        time.sleep(0.2)


def policy_params(policy: str) -> tuple[str, dict[str, str]]:
    """`balanced+up_quiet_s=10+down_persist=1` -> ("balanced", {"morph_up_quiet_s": "10", ...}): a policy with
    its controller thresholds overridden (the server's morph_<name> parameters), measured as a policy of its own
    so a threshold change is compared with the stock policy on the same seeds, back to back. `+lm_head=full`
    sets the head's precision (VARIANT_PARAMS): `full+lm_head=full` is every weight at full precision, where
    `full` binds the quality-neutral INT8 head like every policy by default. `+prefix=off` turns prefix caching
    off (`enable_kv_cache_reuse=false`): capacity with and without reuse, at the same memory. `+sched=no_evict`
    runs TensorRT-LLM's guaranteed_no_evict capacity policy (`batch_scheduler_policy`) instead of max_utilization;
    `+xreuse=off` restarts the prefix cache at each morph swap (`kv_cache_reuse_across_morphs=false`; `+xreuse=on`,
    the default, keeps it)."""
    base, *overrides = policy.split("+")
    params = {}
    for o in overrides:
        name, sep, value = o.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"policy {policy!r}: expected POLICY+NAME=VALUE[+NAME=VALUE], got {o!r}")
        param, values = VARIANT_PARAMS.get(name, (f"morph_{name}", None))
        if values is not None and value not in values:
            raise ValueError(f"policy {policy!r}: {name} takes {' or '.join(values)}, got {value!r}")
        params[param] = value if values is None else values[value]
    return base, params


@dataclass
class Plan:
    traffic: list[Traffic]
    pools: list[int]
    policies: list[str]
    seeds: list[int]
    out: Path
    params: dict[str, str] = field(default_factory=dict)  # --param overrides
    slos: Slos = field(default_factory=Slos)
    precision: float = 0.05
    max_probes: int = 12
    force: bool = False
    progress: bool = False
    warm_bracket: bool = False  # seeds after the first bracket around the previous capacity in precision steps
    overload: float | None = None  # then every policy at this multiple of full's capacity, per seed (overload.py)
    repeat_nearest: int = 0  # then each policy's probes either side of its capacity run this many times more
    overload_only: bool = False  # search full alone, then probe every policy at the overload multiple of it

    def __post_init__(self):
        if self.overload_only and (not self.overload or REFERENCE not in self.policies):
            raise ValueError(f"overload only: needs --overload above 1 and {REFERENCE!r} among the policies")
        if self.repeat_nearest < 0:
            raise ValueError(f"repeat_nearest {self.repeat_nearest}: must be >= 0")
        if self.overload is not None and self.overload <= 1:
            raise ValueError(f"overload multiple {self.overload:g}: must be above 1 (full's capacity x it)")
        for p in self.policies:
            policy_params(p)  # refuse a malformed variant before any server starts
        for t in self.traffic:
            small = [p for p in self.pools if p < t.max_tokens()]
            if small and not enlarges_kv(self.params):  # else each server is checked as it starts (server())
                raise ValueError(f"pool(s) {small} cannot hold one {t.name} request of up to {t.max_tokens()} tokens")

    def server_params(self, pool: int) -> dict[str, str]:
        # The server is told the SLOs it is judged by (a dynamic policy's decode-time and queueing pressures follow).
        slos = {"tpot_slo_s": str(self.slos.tpot_s), "ttft_slo_s": str(self.slos.ttft_s)}
        return {**BASE_PARAMS, **slos, **self.params, "max_tokens_in_paged_kv_cache": str(pool)}

    def run(self) -> None:
        prompts = PromptSource(load_tokenizer(DEFAULT_FRAGMENTS), DEFAULT_CORPUS)
        for traffic in self.traffic:
            print(f"[capacity] traffic {traffic.describe()}", flush=True)
            for pool in self.pools:
                server_started: dict[str, dict] = {}

                def start(policy: str):
                    base, morph = policy_params(policy)
                    logs = REPO_ROOT / "build" / "capacity" / traffic.name / f"pool{pool}" / slug(policy)
                    server_started[policy] = {
                        "server_started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
                        **{f"server_{k}": v for k, v in provenance().items()},
                    }  # the code it runs
                    params = {**self.server_params(pool), **morph}
                    return Server(base, params, logs), int(params.get("block_size", 16))

                def ready(policy: str, handle, block_size: int | None) -> None:
                    if block_size is None:  # kept from an earlier probe
                        wait_idle(handle.metrics_url, policy_params(policy)[0] in DYNAMIC)
                    else:
                        check_starting_kv(starting_kv(handle.metrics_url), block_size, traffic, pool, policy)

                # NOTE: multi-turn traffic replays the same conversations at every rate, so a server kept from the
                # previous probe would serve their prefixes from its cache: each probe gets a fresh one.
                with ProbeServers(start, ready, fresh=traffic.conversations is not None) as servers:
                    self._run_pool(traffic, pool, servers.get, prompts, server_started)

    def _run_pool(self, traffic: Traffic, pool: int, server, prompts, server_started: dict | None = None) -> None:
        searched = [REFERENCE] if self.overload_only else self.policies
        start = {p: traffic.start_rate_scale for p in searched}
        grow = {p: Bisection.grow for p in searched}
        for seed in self.seeds:
            searches = {p: Bisection(start[p], self.precision, grow[p], max_probes=self.max_probes) for p in searched}
            while not all(s.done for s in searches.values()):
                for policy, search in searches.items():  # one step of each policy, back to back
                    rate = search.next_rate()
                    if rate is not None:
                        search.record(
                            rate,
                            self._probe(traffic, pool, policy, seed, rate, server, prompts, server_started)["attained"],
                        )
            for policy, search in searches.items():
                print(
                    f"[capacity] {traffic.name} pool {pool} seed {seed} {policy}: capacity x{search.capacity} "
                    f"({search.status}, {len(search.probes)} probes)",
                    flush=True,
                )
                if search.capacity:  # the next seed starts where this one ended: fewer bracketing probes
                    start[policy] = search.capacity
                    if self.warm_bracket:  # seeds agree to ~10%: 2-3 probes a seed, not 5
                        grow[policy] = warm_grow(self.precision)
            # The verdicts a capacity rests on, run again: how far one probe's attainment moves at the same seed
            # and rate is what a reader needs to weigh one bisection step (repeats never change a capacity).
            for k in range(1, self.repeat_nearest + 1):
                for policy, search in searches.items():
                    for rate in (r for r in (search.lo, search.hi) if r is not None):
                        self._probe(traffic, pool, policy, seed, rate, server, prompts, server_started, repeat=k)
            full = searches.get(REFERENCE)
            if self.overload and full and full.capacity:  # the same requests past full's capacity, back to back
                rate = overload_rate(full.capacity, self.overload)
                for policy in self.policies:
                    self._probe(traffic, pool, policy, seed, rate, server, prompts, server_started, self.overload)

    def _probe(
        self,
        traffic: Traffic,
        pool: int,
        policy: str,
        seed: int,
        rate: float,
        server,
        prompts,
        server_started: dict | None,
        overload: float | None = None,
        repeat: int = 0,
    ) -> dict:
        """The stored probe, or a new one run and stored; an overload probe is marked with its multiple (a stored
        probe that happens to sit at that rate is marked, not run again)."""
        key = store.ProbeKey(traffic.name, pool, policy, seed, rate, repeat)
        path = key.path(self.out)
        if path.exists() and not self.force:
            probe = store.load_probe(path)
            how = "stored"
            if overload and probe.get(MARK) != overload:
                probe = store.mark(path, **{MARK: overload})
        else:
            res, probe = run_probe(traffic, rate, seed, server(policy), prompts, self.slos, self.progress)
            probe["server_params"] = {**self.server_params(pool), **policy_params(policy)[1]}
            probe.update((server_started or {}).get(policy, {}))
            if overload:
                probe[MARK] = overload
            store.save(self.out, key, res, probe)
            how = f"ran {probe['wall_s']:.0f} s, load {probe['load_avg_1m'][0]:.1f}->{probe['load_avg_1m'][1]:.1f}"
        what = (
            f"x{rate:g}"
            + (f" (x{overload:g} full's capacity)" if overload else "")
            + (f" (repeat {repeat})" if repeat else "")
        )
        print(
            f"[capacity] {traffic.name} pool {pool} seed {seed} {policy:>11} {what}: "
            f"{probe['requests']} req at {probe['offered_req_s']:.2f} req/s, attainment "
            f"{probe['attainment']:.1%} -> {'pass' if probe['attained'] else 'fail'} ({how})",
            flush=True,
        )
        return probe
