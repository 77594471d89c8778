"""tools/: the benchmarks, measurement and quality tools."""
