"""End to end through a real tritonserver: a burst makes the server morph, every request completes, and
after the burst it returns to full precision."""

import os
import threading
import time

import pytest
from tests import ROOT
from trtllm_backend.serve import free_ports
from tests.triton.test_triton_server import GrpcStream, inputs, metrics, wait_for

pytestmark = [pytest.mark.needs_model, pytest.mark.server]

# A small KV pool so a burst of long prompts is KV-bound; a quick controller so the test is short.
MORPH_PARAMS = {
    "morph_policy": "balanced",
    "max_tokens_in_paged_kv_cache": "512",
    "max_batch_size": "16",
    "max_queue_size": "64",
    "morph_down_persist": "1",
    "morph_down_queue_wait_s": "0.2",
    "morph_up_quiet_s": "1.0",
    "metrics_interval_s": "0.1",
}


LOG = {}


@pytest.fixture(scope="module")
def morph_server(tmp_path_factory):
    from trtllm_backend import serve

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    http, grpc, metrics_port = free_ports(3)
    log = LOG["path"] = tmp_path_factory.mktemp("triton-morph") / "tritonserver.log"
    handle = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics_port,
        params=MORPH_PARAMS,
        backend_dir=ROOT / "build" / "backends",
        build_dir=ROOT / "build",
        log_path=log,
        ready_timeout=300,
        exit_timeout_s=10,
    )
    try:
        yield handle
    finally:
        handle.stop(timeout=20)
        handle.clean_shm()


def test_burst_morphs_down_and_quiet_restores_full_precision(morph_server):
    before = metrics(morph_server)
    assert before.get("morphserve_int4_layers") == 0 and before.get("morphserve_lm_head_int8", 0) == 0
    text = (
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
        "in want of a wife. However little known the feelings or views of such a man may be on his first "
        "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families. "
    )
    results, peak_int4 = [None] * 12, []

    def client(i):
        s = GrpcStream(morph_server.grpc_url)
        try:
            results[i] = s.request(
                inputs(text_input=f"{i}. " + text * 2, max_tokens=24, min_length=24, stream=True), timeout=600
            )
        finally:
            s.close()

    def watch(stop):
        while not stop.is_set():
            peak_int4.append(metrics(morph_server).get("morphserve_int4_layers", 0))
            time.sleep(0.1)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert all(r is not None and r.error is None for r in results), [r.error for r in results if r]
    assert all(sum(r.counts) == 24 for r in results)
    per_token = [n for r in results for piece in r.int4 for n in piece]
    assert len(per_token) == 12 * 24 and max(per_token) > 0  # the responses say which tokens were made morphed
    during = metrics(morph_server)
    assert during['morphserve_layer_swaps_total{direction="down"}'] > 0 and max(peak_int4) > 0
    assert during['morphserve_kv_resizes_total{direction="grow"}'] > 0
    # After the burst: quiet -> every layer restored, every grown segment released, nothing leaked.
    # (the layers, and the LM head where the set has it as a unit: int4_layers counts layers only)
    # NOTE: the gauges are the engine's last published snapshot, copied every metrics_interval_s, while the success
    # counter ticks at once: wait for a snapshot in which the engine itself holds nothing (no running or waiting
    # request, nothing active in the glue); in that snapshot any used block is a leak.
    ok = before.get('morphserve_requests_total{status="success"}', 0) + 12
    after = wait_for(
        lambda: (
            (m := metrics(morph_server)).get("morphserve_int4_layers") == 0
            and m.get("morphserve_lm_head_int8", 0) == 0
            and m.get('morphserve_requests_total{status="success"}', 0) >= ok
            and all(m.get(f'morphserve_requests{{state="{s}"}}') == 0 for s in ("active", "waiting", "scheduled"))
            and m
        ),
        timeout=120,
        interval=0.5,
    )
    assert after, "the server did not return to full precision after the burst"
    assert (
        after['morphserve_layer_swaps_total{direction="up"}'] == after['morphserve_layer_swaps_total{direction="down"}']
    )
    assert after['morphserve_kv_cache_blocks{type="used"}'] == 0
    # back to the configured pool less the staging reserve a dynamic policy keeps (one INT4 layer: 6.04 blocks)
    assert (
        after["morphserve_kv_capacity_blocks"] - 7
        <= after['morphserve_kv_cache_blocks{type="max"}']
        < after["morphserve_kv_capacity_blocks"]
    )
    assert (
        after['morphserve_kv_resizes_total{direction="shrink"}']
        == after['morphserve_kv_resizes_total{direction="grow"}']
    )
    # Every request counted once, as a success, with all its tokens (a preempted one is recomputed, not recounted).
    done = after['morphserve_requests_total{status="success"}'] - before.get(
        'morphserve_requests_total{status="success"}', 0
    )
    assert done == 12
    assert after["morphserve_generation_tokens_total"] - before.get("morphserve_generation_tokens_total", 0) == 12 * 24
    # One log line per morph action, with its reason.
    text = LOG["path"].read_text()
    assert "morph: swap" in text and "morph: restore" in text
