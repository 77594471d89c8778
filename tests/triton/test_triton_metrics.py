"""trtllm_backend.triton.metrics on its own: engine snapshots -> Prometheus families (a fake pb_utils, as in
tests/triton/test_triton_model_unit.py, since Triton's MetricFamily exists only inside the stub)."""

from __future__ import annotations

import re

import pytest

from tests import ROOT
from tests.triton.test_triton_model_unit import FakeMetricFamily, fake_pb_utils
from trtllm_backend.outputs import EngineStats
from trtllm_backend.triton.metrics import TritonMetrics


@pytest.fixture
def metrics():
    FakeMetricFamily.created.clear()
    return TritonMetrics(fake_pb_utils(), {"model": "m", "version": "1"}, kv_capacity_blocks=64)


def observed(name: str) -> list[float]:
    return FakeMetricFamily.created[name].get().observations


def test_each_swap_is_observed_once_however_often_stats_are_read(metrics):
    first = EngineStats(swap_timings=((0.1, 0.01),), swaps_timed=1)
    metrics.update(first, active=0)
    metrics.update(first, active=0)
    assert observed("morphserve_swap_prepare_seconds") == [0.1]
    metrics.update(EngineStats(swap_timings=((0.1, 0.01), (0.2, 0.02), (0.3, 0.03)), swaps_timed=3), active=0)
    assert observed("morphserve_swap_prepare_seconds") == [0.1, 0.2, 0.3]
    assert observed("morphserve_swap_apply_seconds") == [0.01, 0.02, 0.03]


def test_a_new_engine_counts_from_zero(metrics):
    metrics.update(EngineStats(swap_timings=((0.1, 0.01),) * 5, swaps_timed=5, swaps_down=5), active=0)
    metrics.update(EngineStats(swap_timings=((0.4, 0.04),), swaps_timed=1, swaps_down=1), active=0)
    assert observed("morphserve_swap_prepare_seconds") == [0.1] * 5 + [0.4]
    swaps = FakeMetricFamily.created["morphserve_layer_swaps_total"].get(direction="down")
    metrics.update(EngineStats(swaps_timed=1, swaps_down=3), active=0)
    assert swaps.value == 5 + 2  # counters advance by the difference from the new engine's last total


def test_gauges_follow_the_snapshot(metrics):
    metrics.update(
        EngineStats(
            waiting=3,
            running=2,
            kv_blocks_total=80,
            kv_blocks_used=20,
            kv_blocks_free=60,
            kv_usage=0.25,
            int4_layers=4,
            lm_head_int8=1,
        ),
        active=5,
    )
    get = lambda name, **kw: FakeMetricFamily.created[name].get(**kw).value  # noqa: E731
    assert (
        get("morphserve_requests", state="active"),
        get("morphserve_requests", state="waiting"),
        get("morphserve_requests", state="scheduled"),
    ) == (5, 3, 2)
    assert get("morphserve_kv_cache_blocks", type="max") == 80 and get("morphserve_kv_cache_usage_ratio") == 0.25
    assert get("morphserve_int4_layers") == 4 and get("morphserve_kv_capacity_blocks") == 64
    assert get("morphserve_lm_head_int8") == 1


def test_prefix_cache_counters_and_gauges(metrics):
    metrics.update(
        EngineStats(
            kv_blocks_cached=7,
            prefix_cache_hit_blocks=30,
            prefix_cache_miss_blocks=10,
            prefix_cache_reused_tokens=480,
            prefix_cache_evictions=2,
            prefix_cache_evicted_miss_blocks=4,
        ),
        active=0,
    )
    get = lambda name, **kw: FakeMetricFamily.created[name].get(**kw).value  # noqa: E731
    assert get("morphserve_prefix_cache_blocks_total", result="hit") == 30
    assert get("morphserve_prefix_cache_blocks_total", result="miss") == 10
    assert get("morphserve_prefix_cache_reused_tokens_total") == 480
    assert get("morphserve_prefix_cache_evictions_total") == 2
    assert get("morphserve_prefix_cache_evicted_miss_blocks_total") == 4
    assert get("morphserve_prefix_cache_hit_rate") == 0.75 and get("morphserve_kv_cache_blocks", type="cached") == 7


def test_each_priority_class_has_its_queue_and_latencies(metrics):
    from trtllm_backend.outputs import RequestTimings

    metrics.update(EngineStats(waiting=3, waiting_by_priority=((0, 1), (5, 2))), active=3)
    get = lambda name, **kw: FakeMetricFamily.created[name].get(**kw).value  # noqa: E731
    assert get("morphserve_requests_waiting_by_priority", priority="5") == 2
    metrics.update(EngineStats(waiting=1, waiting_by_priority=((0, 1),)), active=1)
    assert get("morphserve_requests_waiting_by_priority", priority="5") == 0  # seen once: reported at 0
    metrics.request_finished(
        "success", RequestTimings(arrival=1.0, scheduled=1.5, first_token=2.0, finished=3.0), 4, priority=5
    )
    ttft = FakeMetricFamily.created["morphserve_priority_time_to_first_token_seconds"]
    assert ttft.get(priority="5").observations == [1.0]
    queue = FakeMetricFamily.created["morphserve_priority_request_queue_time_seconds"]
    assert queue.get(priority="5").observations == [0.5]


# --- the docs ----------------------------------------------------------------------------------------------------
DOCS = ROOT / "docs" / "configuration.md"


def documented_metrics(text: str) -> dict[str, tuple[str, dict[str, set[str]]]]:
    """The metrics table of docs/configuration.md: name -> (type, {label: values, empty when not listed})."""
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for m in re.finditer(r"^\| `(morphserve_\w+)` \| (\w+) \|([^|]*)\|", section, re.M):
        labels = {}
        for lm in re.finditer(r"`(\w+)`(?:=([\w /]+))?", m.group(3)):
            labels[lm.group(1)] = {v.strip() for v in lm.group(2).split("/")} if lm.group(2) else set()
        rows[m.group(1)] = (m.group(2), labels)
    return rows


def test_docs_metrics_table_matches_the_families(metrics):
    documented = documented_metrics(DOCS.read_text())
    assert set(documented) == set(metrics.families), "docs/configuration.md's metrics table and metrics.py differ"
    for name, family in FakeMetricFamily.created.items():
        kind, labels = documented[name]
        assert kind == family.kind, f"{name}: documented as {kind}, registered as {family.kind}"
        for metric in family.metrics:  # labels beyond model / version, as documented
            extra = {k: v for k, v in metric.labels.items() if k not in ("model", "version")}
            assert set(extra) == set(labels), f"{name}: labels {sorted(extra)}, documented {sorted(labels)}"
            for key, value in extra.items():
                assert not labels[key] or value in labels[key], f"{name}: {key}={value} is not documented"


def test_docs_metrics_check_sees_a_difference():
    table = (
        "\n## Metrics\n\n| Metric | Type | Labels | Meaning |\n|---|---|---|---|\n"
        "| `morphserve_requests` | gauge | `state`=active / waiting | x |\n| `morphserve_int4_layers` | counter | | y |\n"
    )
    assert documented_metrics(table) == {
        "morphserve_requests": ("gauge", {"state": {"active", "waiting"}}),
        "morphserve_int4_layers": ("counter", {}),
    }
