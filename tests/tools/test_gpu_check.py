"""The GPU check (tools/gpu_check) run end to end on the CPU at the tiny shape, so it cannot rot while no GPU is at
hand, and its parts that must be able to say no: the exactness comparison, the budget, a section that raises."""

import json
import subprocess
import sys

import pytest
import torch

from tools.gpu_check import exactness, synth
from tools.gpu_check.__main__ import main
from tools.gpu_check.reference import Reference
from tools.gpu_check.report import RESULT_FILE, Run
from tools.gpu_check.shapes import SHAPES

TINY = SHAPES["tiny"]
BATCHES = [1, 4]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    rc = main(
        [
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--out",
            str(out),
            "--threads",
            "1",
            "--bandwidth-mib",
            "16",
            "--batches",
            ",".join(map(str, BATCHES)),
            "--budget-s",
            "300",
        ]
    )
    data = json.loads((out / RESULT_FILE).read_text())
    return rc, data


def test_the_run_is_recorded_whole(result):
    rc, data = result
    assert data["device"]["device"] == "cpu" and data["device"]["name"]
    assert data["command"].startswith("python -m tools.gpu_check") and "commit" in data
    assert set(data["sections"]) == {
        "bandwidth",
        "fragments:tiny",
        "exactness",
        "decode:tiny",
        "swaps:tiny",
        "burst:tiny",
    }
    assert not data["skipped"] and all(s["status"] != "error" for s in data["sections"].values()), data["sections"]
    assert rc == (0 if data["ok"] else 1)
    # On a shared 2-core CPU a swap can outlast one decode step (the staging thread takes a core): the stall check
    # is the GPU's to pass; every other check passes here.
    failed = {n for n, s in data["sections"].items() if s["status"] == "failed"}
    assert failed <= {"swaps:tiny"}
    bw = data["sections"]["bandwidth"]
    assert bw["bytes"] == 16 << 20 and bw["bytes_per_s"] > 0


def test_exactness_matches_the_reference(result):
    ex = result[1]["sections"]["exactness"]
    assert ex["status"] == "passed"
    assert min(ex["prompt_min_gaps"]) >= exactness.MIN_GAP
    for precision, int4_layers in (("full", 0), ("int4", TINY.config.num_layers)):
        r = ex[precision]
        assert r["ok"] and r["tokens_equal"] and r["placement_ok"]
        assert r["relative_diff"] <= r["tolerance"] == exactness.TOLERANCE[(precision, torch.float32)]
        assert r["max_abs_reference_logit"] > 1  # a real comparison, not of near-zero logits
        assert r["engine"]["int4_layers"] == int4_layers and r["engine"]["dtype"] == "float32"
        assert [len(q["engine_tokens"]) for q in r["requests"]] == [exactness.MAX_TOKENS] * len(
            exactness.PROMPT_LENGTHS
        )
        assert all(q["engine_tokens"] == q["reference_tokens"] for q in r["requests"])
        assert set(r["engine"]["placement"]["layers"]) == {"cpu"}


def test_decode_rows_carry_the_floor(result):
    dec = result[1]["sections"]["decode:tiny"]
    assert dec["status"] == "passed" and dec["bandwidth_GBps"] > 0
    for policy in ("full", "int4"):
        rows = dec[policy]["rows"]
        assert [r["batch"] for r in rows] == BATCHES
        for r in rows:
            assert r["tok_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3), rel=0.01)
            assert r["bytes_read_per_step"] > dec[policy]["weights_read_per_step"]  # the cached K/V on top
            assert r["floor_tok_s"] > 0 and r["share_of_floor"] == pytest.approx(
                r["floor_step_ms"] / r["step_ms"], rel=0.01
            )
    # INT4 layers read about a quarter of fp32's bytes per weight
    assert dec["int4"]["weights_read_per_step"] < 0.6 * dec["full"]["weights_read_per_step"]


def test_every_layer_swaps_down_and_back(result):
    sw = result[1]["sections"]["swaps:tiny"]
    n = TINY.config.num_layers
    assert sw["layers_swapped"] == n and sw["down"]["count"] == n and sw["up"]["count"] == n
    assert {k: v for k, v in sw["checks"].items() if k != "no_stall"} == dict.fromkeys(
        ["all_swapped_down", "all_restored", "no_swap_failures", "no_invariant_violations", "no_request_errors"], True
    )
    downs = [s for s in sw["swaps"] if s["kind"] == "down"]
    assert [s["int4_layers"] for s in downs] == list(range(1, n + 1))
    assert all(s["kv_blocks_after"] > s["kv_blocks_before"] and s["stage_ms"] > 0 and s["bind_ms"] > 0 for s in downs)
    assert sw["kv_blocks"]["peak"] == sw["kv_blocks"]["start"] + sw["down"]["kv_blocks_gained"]
    assert sw["kv_blocks"]["end"] == sw["kv_blocks"]["start"]  # every restore gave its KV segment back
    assert sw["checks"]["no_stall"] == (sw["max_decode_step_ms_during_swaps"] <= 2 * sw["baseline_decode_step_ms"])


def test_burst_compares_the_policies_at_one_budget(result):
    b = result[1]["sections"]["burst:tiny"]
    assert b["status"] == "passed" and all(b["checks"].values())
    full, balanced = b["full"], b["balanced"]
    assert full["memory_budget_bytes"] == balanced["memory_budget_bytes"] == b["memory_budget_bytes"] > 0
    for r in (full, balanced):
        assert r["completed"] == TINY.burst_requests and r["ttft_p95_s"] >= r["ttft_p50_s"] > 0
        assert r["queue_peak"] > 0  # the pool was small enough for a queue to form
        assert r["kv_blocks_used_peak"] <= r["kv_blocks_total_peak"]
        assert r["memory_used_peak_bytes"] <= r["memory_budget_bytes"]
    assert full["swaps_down"] == 0 and full["int4_layers_peak"] == 0  # full only queues


def test_the_comparison_can_fail(tmp_path):
    """The engine's rows are judged by a reference: rows and tokens of another model are out of tolerance."""
    synth.build_set(tmp_path / "a", TINY, "cpu", seed=0)
    synth.build_set(tmp_path / "b", TINY, "cpu", seed=1)
    ref, other = Reference(tmp_path / "a"), Reference(tmp_path / "b")
    prompts = [[5, 6, 7, 8, 9]]
    tokens = {"p0": other.greedy(torch.tensor(prompts), 4, [1])[0][0].tolist()}
    rows = {"p0": list(other.logits(prompts[0] + tokens["p0"][:-1])[4:])}
    res = exactness.compare(ref, prompts, tokens, rows, [1], torch.float32, "full")
    assert not res["within_tolerance"] and res["relative_diff"] > 0.1
    same = exactness.compare(other, prompts, tokens, rows, [1], torch.float32, "full")
    assert same["within_tolerance"] and same["tokens_equal"] and same["max_abs_diff"] < 1e-4


def test_budget_skips_and_errors_are_recorded(tmp_path):
    run = Run(tmp_path, budget_s=60, meta={})

    def boom():
        raise RuntimeError("no kernel image for this device")

    assert run.section("a", boom, need_s=1)["status"] == "error"
    assert run.section("b", lambda: {"ok": True}, need_s=1, not_after=("a",))["status"] == "skipped"
    assert run.section("c", lambda: {"ok": True}, need_s=1, needs=("a",))["status"] == "skipped"
    assert run.section("d", lambda: {"ok": True}, need_s=1e6)["reason"].startswith("budget")
    assert run.section("e", lambda: {"x": 1}, need_s=1)["status"] == "measured"
    assert run.finish() is False
    data = json.loads((tmp_path / RESULT_FILE).read_text())
    assert "no kernel image" in data["sections"]["a"]["traceback"] and data["skipped"] == ["b", "c", "d"]


def test_a_short_budget_skips_cleanly(tmp_path):
    rc = main(
        [
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--out",
            str(tmp_path),
            "--budget-s",
            "3",
            "--threads",
            "1",
            "--bandwidth-mib",
            "16",
        ]
    )
    data = json.loads((tmp_path / RESULT_FILE).read_text())
    assert rc == 0 and data["ok"] and data["skipped"]  # skipped is not failed
    assert all(s["status"] in ("skipped", "measured") for s in data["sections"].values())


def test_an_engine_that_cannot_run_stops_the_run_early(tmp_path, monkeypatch):
    """What the first CUDA run may meet: the engine raises on its first step. The error names where the engine's
    tensors are, and the later sections are skipped rather than run into the same error (the lease is kept)."""
    from trtllm_backend.engine import LLMEngine

    def step(self):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(LLMEngine, "step", step)
    rc = main(
        ["--device", "cpu", "--shapes", "tiny", "--out", str(tmp_path), "--threads", "1", "--bandwidth-mib", "16"]
    )
    data = json.loads((tmp_path / RESULT_FILE).read_text())
    ex = data["sections"]["exactness"]
    assert rc == 1 and ex["status"] == "error"
    assert (
        "full engine: RuntimeError: Expected all tensors" in ex["error"]
        and "placement: {'layers': {'cpu'" in ex["error"]
    )
    later = ["decode:tiny", "swaps:tiny", "burst:tiny"]
    assert [data["sections"][n]["reason"] for n in later] == ["exactness raised"] * 3 and data["skipped"] == later


def test_it_imports_nothing_the_gpu_machine_lacks():
    """The lent GPU machine has torch, numpy, safetensors, tokenizers, transformers (and its tqdm): nothing else."""
    code = (
        "import importlib.abc, sys\n"
        "BLOCK = {'gguf', 'tritonclient', 'pytriton', 'fastapi', 'uvicorn', 'matplotlib', 'hypothesis', 'jinja2',\n"
        "         'prometheus_client', 'modelopt', 'httpx', 'openai', 'uvloop', 'httptools'}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCK:\n"
        "            raise ImportError(name + ' is not on the GPU machine')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tools.gpu_check.__main__\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
