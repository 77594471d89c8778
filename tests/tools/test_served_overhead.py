"""tools.served_overhead's accounting: /proc thread CPU times, the TPOT histogram, CPU per token."""

from __future__ import annotations

import os
import threading
import time

from tools.served_overhead import cpu_per_token, histogram_sum_count, thread_cpu_s


def test_thread_cpu_times_see_a_busy_thread_of_this_process():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = thread_cpu_s(os.getpid())
        # NOTE: a wait for the CPU time to show, not a fixed window: on a loaded machine the spinning thread
        # may get little of any given 0.3 s
        deadline, gained = time.monotonic() + 60, 0.0
        while gained <= 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
            after = thread_cpu_s(os.getpid())
            assert t.native_id in after
            gained = after[t.native_id][1] - before.get(t.native_id, ("", 0.0))[1]
    finally:
        stop.set()
        t.join()
    assert gained > 0.05  # its own CPU time, as /proc counts it, grew while it spun


def test_histogram_sum_and_count_ignore_buckets_and_other_metrics():
    page = "\n".join(
        [
            "# HELP morphserve_time_per_output_token_seconds Time per output token",
            'morphserve_time_per_output_token_seconds_bucket{le="0.01"} 3',
            "morphserve_time_per_output_token_seconds_sum 0.125",
            "morphserve_time_per_output_token_seconds_count 5",
            "morphserve_time_to_first_token_seconds_sum 9",
        ]
    )
    assert histogram_sum_count(page, "morphserve_time_per_output_token_seconds") == (0.125, 5.0)
    assert histogram_sum_count("", "x") == (0.0, 0.0)


def test_cpu_per_token_counts_new_threads_from_zero_and_orders_the_largest_first():
    before = {7: {1: ("main", 1.0), 2: ("worker", 0.5)}}
    after = {7: {1: ("main", 1.2), 2: ("worker", 0.5), 3: ("late", 0.4)}}
    out = cpu_per_token(before, after, tokens=100)
    assert abs(out[7]["ms_per_token"] - 6.0) < 1e-9  # (0.2 + 0.4) s over 100 tokens
    assert [t["tid"] for t in out[7]["threads"]] == [3, 1]  # idle threads left out


def test_streams_and_requests_must_be_positive_before_any_server_starts():
    import pytest

    from tools.served_overhead import main

    for bad in (["--streams", "0"], ["--requests", "0"], ["--output-tokens", "1"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2  # argparse's usage error, raised before launch()
