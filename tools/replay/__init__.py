"""Trace replay: bursty open-loop load against real Triton servers, one policy at a time, and the report.

Entry points (from the repository root; docs/replay.md):
    python -m tools.replay            one replay against a server you started
    python -m tools.replay.compare    every policy on a fresh server each, the saturation sweep, the report

Modules, each one concept:
    traces    arrival traces: read, window, scale, or synthesize
    prompts   prompts of an exact token length cut from the corpus
    workload  the workload options, and a trace turned into planned requests
    client    one timed streamed request (gRPC or HTTP SSE)
    sampler   the server's Prometheus metrics over time
    runner    the open-loop run of a planned window, with its unloaded probes
    result    a run's records and samples, saved and loaded
    metrics   TTFT / TPOT / ITL / E2EL, throughput, goodput, SLO violations, quality weighting
    quality   the perplexity-by-INT4-layers table
    servers   a fresh tritonserver per policy on free ports
    settings  the comparison's server settings, workloads and shared SLO
    comparison  every policy against its own server
    sweep     the saturation sweep
    tables    the text tables: one run's summary, the comparison, the targets, the sweep
    plots     the PNGs
    report    the report folder: report.md, summary.json, plots
    narrative the report's reading, generated from the tables' data; notes.md checked against it
    provenance  the commit a run ran on
    paths     repository-relative paths
"""
