"""The session tritonserver's settings (tests/conftest.py starts it) and a readiness probe, for the tests that
start servers of their own beside it."""

from __future__ import annotations

import urllib.request

# The test server's overrides of config.pbtxt. The queue is large enough for 16 concurrent clients but small
# enough that a burst of 40 requests overflows it. Morphing is pinned off: these tests compare served greedy
# output with full-precision offline runs (the morph tests force swaps on purpose elsewhere).
TEST_SERVER_PARAMS = {
    "morph_policy": "full",
    "max_tokens_in_paged_kv_cache": "2048",
    "max_batch_size": "16",
    "max_queue_size": "20",
    "default_max_tokens": "16",
    "metrics_interval_s": "0.1",
    "cancel_poll_interval_s": "0.02",
    "drain_timeout_s": "2",
}


def http_ready(http_url: str, timeout_s: float = 10) -> bool:
    """Triton's readiness endpoint at host:port answers 200."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False
