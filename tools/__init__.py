"""Developer tools (engine benchmark, LIS profiler, quality, perf_analyzer wrapper, trace replay), run as modules
from the repository root: `python -m tools.<name>`; the trace-replay harness is the package `tools.replay`."""
