"""One capacity claim read across several capacity runs (each a capacity.json from `python -m tools.capacity`).

A single run has three seeds at most an afternoon allows, and with n = 3 Student's t is 4.30: the interval of
a ratio is wide however steady the server. Runs made on different commits and VM states are not one
population either (a faster VM raises both policies' capacity and moves their ratio), so this reads them two
ways and prints both:

- **per seed**: every (run, seed) pair's own ratio, policy / full, measured back to back in that run, pooled
  into one Student-t interval (n = all pairs). It treats the runs as exchangeable.
- **per run**: each run's ratio of mean capacities, then a t interval over the runs (n = runs): the honest
  one when the VM state or the commit moves the ratio, since it counts each run once.

    python -m tools.capacity.pooled results/replay/capacity_pool256_*/capacity.json --traffic conv --pool 256
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.capacity.analysis import REFERENCE
from tools.capacity.report import TARGET_RATIO, TARGET_RATIO_LO, meets_ratio_target
from tools.capacity.stats import Interval, mean_interval


@dataclass(slots=True, frozen=True)
class SeedRatio:
    run: str  # the run's label (its folder)
    seed: int
    full: float
    policy: float
    bracketed: bool  # both searches found a failing rate: the ratio is a value, not a bound

    @property
    def ratio(self) -> float:
        return self.policy / self.full


@dataclass(slots=True, frozen=True)
class RunRatio:
    run: str
    commits: tuple[str, ...]
    full: Interval
    policy: Interval
    ratio: Interval  # the run's own (Fieller) interval, as capacity.json holds it
    seeds: tuple[SeedRatio, ...]


def interval_of(d: dict) -> Interval:
    """An Interval from its capacity.json form ({mean, ci95: [lo, hi], n})."""
    lo, hi = d["ci95"]
    return Interval(d["mean"], lo, hi, d["n"])


def read_run(path: Path, traffic: str, pool: int, policy: str) -> RunRatio | None:
    """The run's figures for (traffic, pool) and policy against full; None when the run did not measure both."""
    data = json.loads(path.read_text())
    label = path.parent.name if path.name == "capacity.json" else str(path)
    for cell in data.get("cells", []):
        if cell.get("traffic") != traffic or cell.get("pool_tokens") != pool:
            continue
        ref, pol = cell["policies"].get(REFERENCE), cell["policies"].get(policy)
        if not ref or not pol or not pol.get("ratio_to_full"):
            return None
        full = {s["seed"]: s for s in ref["per_seed"] if s.get("capacity_rate_scale")}
        seeds = tuple(
            SeedRatio(
                label,
                s["seed"],
                full[s["seed"]]["capacity_rate_scale"],
                s["capacity_rate_scale"],
                bool(s.get("failed_above") and full[s["seed"]].get("failed_above")),
            )
            for s in pol["per_seed"]
            if s.get("capacity_rate_scale") and s["seed"] in full
        )
        if not seeds:
            return None
        return RunRatio(
            label,
            tuple(data.get("commits", [])),
            interval_of(ref["capacity_rate_scale"]),
            interval_of(pol["capacity_rate_scale"]),
            interval_of(pol["ratio_to_full"]),
            seeds,
        )
    return None


@dataclass(slots=True, frozen=True)
class Pooled:
    runs: tuple[RunRatio, ...]
    per_seed: Interval
    per_run: Interval

    def meets_target(self, iv: Interval) -> bool:
        return meets_ratio_target(iv)


def pool(runs: list[RunRatio]) -> Pooled:
    if not runs:
        raise ValueError("no run measured both policies at this traffic kind and pool size")
    seeds = [s.ratio for r in runs for s in r.seeds]
    return Pooled(tuple(runs), mean_interval(seeds), mean_interval([r.ratio.mean for r in runs]))


def render(p: Pooled, traffic: str, pool_tokens: int, policy: str) -> str:
    def short(iv: Interval) -> str:
        return iv.fmt(3)

    runs = f"{len(p.runs)} run{'s' if len(p.runs) > 1 else ''}"
    lines = [
        f"## {policy} / {REFERENCE}, {traffic} traffic, KV pool {pool_tokens} tokens, over {runs}",
        "",
        "| run | commits | full capacity | policy capacity | ratio [95% CI, the run's own] | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for r in p.runs:
        per_seed = ", ".join(f"{s.seed}: {s.ratio:.2f}{'' if s.bracketed else ' (bound)'}" for s in r.seeds)
        commits = ", ".join(r.commits[:3]) + (f" +{len(r.commits) - 3}" if len(r.commits) > 3 else "")
        lines.append(f"| {r.run} | {commits} | {short(r.full)} | {short(r.policy)} | {short(r.ratio)} | {per_seed} |")
    every = [s.ratio for r in p.runs for s in r.seeds]
    target = f"target: mean >= {TARGET_RATIO}, lower end >= {TARGET_RATIO_LO}"
    lines += [
        "",
        f"- **Per seed** (n = {p.per_seed.n} pairs, runs treated as one population): {short(p.per_seed)}"
        f" ({target}: {'met' if p.meets_target(p.per_seed) else 'not met'}); lowest {min(every):.2f}, "
        f"highest {max(every):.2f}; {sum(x >= TARGET_RATIO for x in every)} of {len(every)} at or above "
        f"{TARGET_RATIO}.",
        f"- **Per run** (n = {p.per_run.n} runs, each counted once): {short(p.per_run)}"
        f" ({target}: {'met' if p.meets_target(p.per_run) else 'not met'}).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.capacity.pooled",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", type=Path, help="capacity.json files")
    ap.add_argument("--traffic", default="conv")
    ap.add_argument("--pool", type=int, default=256, help="KV pool size in tokens")
    ap.add_argument("--policy", default="balanced")
    ap.add_argument("--out", type=Path, help="write the markdown here as well")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.runs if not p.is_file()]
    if missing:
        ap.error(f"no such capacity.json: {', '.join(missing)}")
    runs = [r for p in args.runs if (r := read_run(p, args.traffic, args.pool, args.policy))]
    try:
        text = render(pool(runs), args.traffic, args.pool, args.policy)
    except ValueError as e:
        print(f"[pooled] {e}", file=sys.stderr)
        return 2
    print(text)
    if args.out:  # a committed report names what made it; each run's own report.md holds its probes' loads
        command = " ".join(["python -m tools.capacity.pooled", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(
            f"Command: `{command}`. Derived from the runs below: their report.md files hold every "
            f"probe's commit, time and machine load.\n\n{text}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
