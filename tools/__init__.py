"""Developer tools (benchmarks, profiler, quality, trace replay), run as modules from the repository root:
`python -m tools.<name>` (README, "Tools")."""
