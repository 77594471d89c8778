"""Shared fixtures. `triton_server`: one real tritonserver for the whole session (started by the launcher on
free ports, with a small KV pool and short intervals so the suite stays fast)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import ROOT
from tests.triton_fixtures import TEST_SERVER_PARAMS
from trtllm_backend.openmp_env import with_openmp_defaults
from trtllm_backend.serve import free_ports


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
    from tests.engine_fixtures import layers_only_copy

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
