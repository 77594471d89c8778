"""Shared fixtures. `triton_server`: one real tritonserver for the whole session (started by the launcher on
free ports, with a small KV pool and short intervals so the suite stays fast)."""

from __future__ import annotations

import urllib.request

import os
from pathlib import Path

import pytest

from trtllm_backend.openmp_env import with_openmp_defaults
from trtllm_backend.serve import free_ports

ROOT = Path(__file__).resolve().parent.parent

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


def fragments_present() -> bool:
    """A manifest where the model tests look for one (cheap: the tests verify the files they load)."""
    from engines.build_fragments import default_fragment_dir

    return (Path(os.environ.get("MORPHSERVE_TEST_FRAGMENTS") or default_fragment_dir()) / "manifest.json").is_file()


def pytest_collection_modifyitems(config, items):
    # NOTE: `slow` meant "needs the real model" before the tiers; a branch's test still marked only `slow` keeps
    # that meaning. Without the fragments a model test is skipped with the step that builds them, not left to fail
    # on a missing file halfway through a fixture.
    missing = (
        None
        if fragments_present()
        else pytest.mark.skip(reason="needs the model's fragments: run `make setup` (tools/setup.sh) first")
    )
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("needs_model"):
            item.add_marker(pytest.mark.needs_model)
        if missing and item.get_closest_marker("needs_model"):
            item.add_marker(missing)


@pytest.fixture(scope="session")
def layer_set(tmp_path_factory) -> Path:
    """The real fragment set without the embedding / LM head unit: its units are the layers."""
    from engine_fixtures import layers_only_copy

    return layers_only_copy(tmp_path_factory.mktemp("fragments") / "layers")


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    from trtllm_backend import serve

    with_openmp_defaults(os.environ)
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    handle = serve.launch(
        ROOT / "model_repository",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        params=TEST_SERVER_PARAMS,
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
        # NOTE: only this server's regions (its own prefix): another server on the machine may be running.
        leaked = handle.clean_shm()
        if leaked:
            print(f"[conftest] removed leaked shared memory: {[p.name for p in leaked]}")
        assert not handle.stub_died, "the Python backend stub died during the session"


def http_ready(http_url: str, timeout_s: float = 10) -> bool:
    """Triton's readiness endpoint at host:port answers 200."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False
