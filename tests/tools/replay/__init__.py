"""tools/replay: the trace replay harness."""
