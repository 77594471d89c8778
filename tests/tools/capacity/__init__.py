"""tools/capacity: the capacity harness."""
