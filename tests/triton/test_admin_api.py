"""Triton's admin APIs closed by default (trtllm_backend/triton/admin.py): on a real tritonserver started by
`launch()` with its defaults, a client without the key cannot register shared memory, change logging or tracing,
or load / unload models, over HTTP or gRPC (tritonclient), while inference, health, metadata, config and
statistics stay open; the same calls with the handle's key header succeed. A toy Python model keeps the server
small (explicit model control, so that load / unload really act). Plus the launcher's key file, flags and bind
address, and the compose file's rule."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from tests import ROOT

from trtllm_backend.serve import free_ports
from trtllm_backend import serve
from trtllm_backend.triton import admin
from trtllm_backend.triton.server import launch

ECHO_CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "text_output", pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().astype(np.object_))])
            for r in requests]
"""


# --- the launcher's pieces, no server -------------------------------------------------------------------------
def test_the_flags_close_the_four_admin_categories_on_both_protocols():
    key = admin.new_key()
    assert admin.restricted_args(key) == [
        f"--http-restricted-api=shared-memory,model-repository,logging,trace:morphserve-admin-key={key}",
        f"--grpc-restricted-protocol=shared-memory,model-repository,logging,trace:morphserve-admin-key={key}",
    ]
    own = ["--http-restricted-api=logging:x=y"]  # the operator's own flag for a protocol wins
    assert admin.restricted_args(key, own) == [admin.restricted_args(key)[1]]
    assert admin.headers(key) == {"morphserve-admin-key": key, "triton-grpc-protocol-morphserve-admin-key": key}
    assert admin.headers(None) == {}
    assert len({admin.new_key() for _ in range(20)}) == 20 and len(key) >= 40
    for bad in ("", "a:b", "a,b", "a=b", "a b"):
        with pytest.raises(ValueError):
            admin.check_key(bad)


def test_the_key_file_is_private(tmp_path):
    path = admin.write_key_file(tmp_path / "run" / "admin-key.8000", "k1")
    assert path.read_text() == "k1\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)
    admin.write_key_file(path, "k2")  # rewritten: private again
    assert admin.read_key_file(path) == "k2" and stat.S_IMODE(path.stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not a private folder"):
        admin.write_key_file(shared / "k", "k")
    link = tmp_path / "run" / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        admin.write_key_file(link, "k")  # never follows a link planted at the path
    assert not (tmp_path / "elsewhere").exists()
    assert admin.default_key_file(8000, {"XDG_RUNTIME_DIR": "/run/user/5"}) == Path(
        "/run/user/5/morphserve/admin-key.8000"
    )
    assert admin.default_key_file(8000, {admin.KEY_FILE_ENV: "/k"}) == Path("/k")


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """serve.main up to launch(): the keyword arguments it passes, and the key file as it was then."""
    seen = {}

    def fake_launch(repo, **kwargs):
        seen.update(kwargs)
        seen["key_file"] = [(f, f.read_text(), stat.S_IMODE(f.stat().st_mode)) for f in tmp_path.glob("keys/*")]
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(serve, "launch", fake_launch)
    for var in (admin.ADMIN_KEY_ENV, admin.OPEN_ADMIN_ENV, "MORPHSERVE_TRITON_ADDRESS", "OPENAI_GATEWAY_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(admin.KEY_FILE_ENV, str(tmp_path / "keys" / "admin-key"))

    def run(*argv: str) -> dict:
        seen.clear()
        assert serve.main([*argv, "--no-build-fragments"]) == 2
        return dict(seen)

    return run


def test_the_cli_closes_the_admin_apis_with_a_key_in_a_private_file(cli, monkeypatch, capsys, tmp_path):
    seen = cli()
    assert seen["open_admin"] is False and seen["address"] is None
    ((path, text, mode),) = seen["key_file"]  # written before the server starts, removed when it stops
    assert text == seen["admin_key"] + "\n" and mode == 0o600
    assert not path.exists()  # the launch failed: the key file went with it
    assert seen["admin_key"] not in capsys.readouterr().out
    assert cli("--open-admin")["admin_key"] is None
    monkeypatch.setenv(admin.ADMIN_KEY_ENV, "operators-key")
    seen = cli()
    assert seen["admin_key"] == "operators-key" and seen["key_file"] == []  # the operator knows it: no file
    monkeypatch.setenv(admin.OPEN_ADMIN_ENV, "1")
    assert cli()["open_admin"] is True


def test_a_keyed_gateway_keeps_triton_on_loopback(cli, monkeypatch):
    assert cli("--openai-port", "9999")["address"] is None  # an open gateway: nothing changes
    monkeypatch.setenv("OPENAI_GATEWAY_API_KEY", "gw")
    assert cli("--openai-port", "9999")["address"] == "127.0.0.1"
    assert cli("--openai-port", "9999", "--address", "0.0.0.0")["address"] == "0.0.0.0"  # the operator's word
    assert cli()["address"] is None  # no gateway in front


def test_compose_passes_the_admin_settings_and_binds_triton_locally_behind_a_keyed_gateway():
    text = (ROOT / "docker" / "compose.yaml").read_text()
    svc = yaml.safe_load(text)["services"]
    local = "${MORPHSERVE_TRITON_ADDRESS:-${MORPHSERVE_OPENAI_API_KEY:+127.0.0.1}}"
    for name in ("triton", "triton-gpu", "replica-1", "replica-2"):
        env = svc[name]["environment"]
        assert env["MORPHSERVE_ADMIN_KEY"] == "${MORPHSERVE_ADMIN_KEY:-}", name
        assert env["MORPHSERVE_OPEN_ADMIN"] == "${MORPHSERVE_OPEN_ADMIN:-}", name
        assert env["MORPHSERVE_TRITON_ADDRESS"] == local, name
    assert "--open-admin" not in text and "restricted" not in text  # closed unless the operator opens it


# --- a real server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("admin") / "repo"
    for name in ("echo", "echo2"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(ECHO_CONFIG)
        (repo / name / "1" / "model.py").write_text(ECHO_MODEL)
    return repo


def _launch(repo: Path, **kwargs):
    http, grpc, metrics = free_ports(3)
    return launch(
        repo,
        model="echo",
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        check_params=False,
        backend_dir=ROOT / "build" / "backends",
        log_path=repo.parent / f"server-{uuid.uuid4().hex[:6]}.log",
        ready_timeout=120,
        exit_timeout_s=5,
        extra_args=["--model-control-mode=explicit", "--load-model=echo"],
        **kwargs,
    )


@pytest.fixture(scope="module")
def server(toy_repo):
    for var in (admin.ADMIN_KEY_ENV, admin.OPEN_ADMIN_ENV):
        assert not os.environ.get(var), f"unset ${var} to run these tests"
    handle = _launch(toy_repo)  # the defaults: closed, a key of its own
    try:
        yield handle
    finally:
        handle.stop(timeout=20)
        assert not handle.stub_died


@pytest.fixture
def region():
    """A real system shared-memory region to register (8 bytes)."""
    name = f"morphserve_admin_test_{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name  # what shm_open("/<name>") opens (tritonclient's helper needs pkg_resources)
    path.write_bytes(bytes(8))
    try:
        yield "/" + name
    finally:
        path.unlink(missing_ok=True)


def _refused(call, *args, **kwargs) -> str:
    with pytest.raises(InferenceServerException) as exc:
        call(*args, **kwargs)
    assert "restricted" in str(exc.value) and "morphserve-admin-key" in str(exc.value), str(exc.value)
    return str(exc.value)


def _echo(client, module) -> str:
    inp = module.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    return client.infer("echo", [inp]).as_numpy("text_output")[0].decode()


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_without_the_key_the_admin_apis_refuse_and_inference_works(server, protocol, region):
    module, url = (httpclient, server.http_url) if protocol == "http" else (grpcclient, server.grpc_url)
    client = module.InferenceServerClient(url)
    assert server.admin_key and server.admin_headers
    _refused(client.register_system_shared_memory, "r", region, 8)
    _refused(client.get_system_shared_memory_status)
    _refused(client.update_log_settings, {"log_verbose_level": 3})
    _refused(client.get_log_settings)
    _refused(client.update_trace_settings, settings={"trace_level": ["TIMESTAMPS"]})
    _refused(client.get_trace_settings)
    _refused(client.load_model, "echo2")
    _refused(client.unload_model, "echo")
    _refused(client.get_model_repository_index)
    # nothing changed, and everything a client of the model needs is open
    # (server readiness itself turns false once a model was unloaded: Triton's strict readiness)
    assert client.is_server_live() and client.is_model_ready("echo")
    assert not client.is_model_ready("echo2")
    assert client.get_server_metadata() and client.get_model_metadata("echo") and client.get_model_config("echo")
    assert client.get_inference_statistics("echo")
    assert _echo(client, module) == "hello"
    # and with the key header, over the same protocol
    keyed = {"headers": server.admin_headers}
    level = client.get_log_settings(**keyed)
    client.update_log_settings({"log_verbose_level": 1}, **keyed)
    after = client.get_log_settings(**keyed)
    verbose = after["log_verbose_level"] if protocol == "http" else after.settings["log_verbose_level"].uint32_param
    assert verbose == 1
    client.update_log_settings({"log_verbose_level": 0}, **keyed)
    assert level is not None
    client.update_trace_settings(settings={"trace_rate": "1000"}, **keyed)
    trace = client.get_trace_settings(**keyed)
    rate = trace["trace_rate"] if protocol == "http" else trace.settings["trace_rate"].value[0]
    assert rate == "1000"
    client.register_system_shared_memory("r", region, 8, **keyed)
    status = client.get_system_shared_memory_status(**keyed)
    assert "r" in (str(status) if protocol == "grpc" else {s["name"] for s in status})
    client.unregister_system_shared_memory("r", **keyed)
    client.load_model("echo2", **keyed)
    assert client.is_model_ready("echo2")
    client.unload_model("echo2", **keyed)
    assert _wait(lambda: not client.is_model_ready("echo2"))
    assert client.get_model_repository_index(**keyed)
    assert _echo(client, module) == "hello" and server.alive()
    client.close()


@pytest.mark.server
def test_a_wrong_key_is_refused(server):
    client = httpclient.InferenceServerClient(server.http_url)
    _refused(client.update_log_settings, {"log_verbose_level": 1}, headers=admin.headers("not-the-key"))
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    _refused(grpc.update_log_settings, {"log_verbose_level": 1}, headers=admin.headers("not-the-key"))


@pytest.mark.server
def test_an_operator_key_and_open_admin(toy_repo, monkeypatch):
    monkeypatch.setenv(admin.ADMIN_KEY_ENV, "operators-own-key")
    with _launch(toy_repo) as handle:
        assert handle.admin_key == "operators-own-key"
        client = httpclient.InferenceServerClient(handle.http_url)
        _refused(client.get_log_settings)
        assert client.get_log_settings(headers={"morphserve-admin-key": "operators-own-key"})
        assert "operators-own-key" not in handle.log_path.read_text()  # Triton's log never shows it
    monkeypatch.delenv(admin.ADMIN_KEY_ENV)
    with _launch(toy_repo, open_admin=True, address="127.0.0.1") as handle:
        assert handle.admin_key is None and handle.admin_headers == {}
        client = httpclient.InferenceServerClient(handle.http_url)
        assert client.get_log_settings() and client.get_model_repository_index()  # the old behaviour


def _wait(predicate, timeout: float = 60.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()
