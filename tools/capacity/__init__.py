"""Capacity by search: the highest arrival rate each morph policy serves within fixed SLOs (docs/capacity.md).

    python -m tools.capacity [--traffic conv,code] [--pools 512] [--policies full,balanced] [--seeds 0,1,2]

Modules, each one concept:
    slo       the fixed SLOs (seconds) and a run's attainment under them
    traffic   the traffic kinds (Azure conversation: decode-heavy; Azure code: prefill-heavy; multi-turn chat,
              plain or mixed-priority, from conversations) and their scaling
    search    bisection of one policy's capacity over the arrival-rate scale, for one seed
    stats     95% intervals: Student t over seeds, Fieller for a ratio of paired means
    store     one probe's raw result on disk (resumable: what exists is skipped)
    probe     one probe: a planned window replayed against a running server
    plan      the measurement plan: traffic x pool x seed x policy, policies interleaved per seed
    analysis  capacities, ratios, frontier and regime numbers from the stored probes
    classes   attainment per priority class on mixed traffic
    reuse     capacity with and without prefix reuse (`+prefix=off`)
    plots     the PNGs
    report    report.md and capacity.json
"""
