"""deploy/sizing.py: the shape arithmetic against the measured fragments, the GPU scaling, the trace statistics
and clear errors on bad inputs."""

from __future__ import annotations

import json
import sys

import pytest

from tests import ROOT


sys.path.insert(0, str(ROOT / "deploy"))
import sizing  # noqa: E402  (deploy/ is a folder of manifests and this script, not a package)


@pytest.mark.needs_model
def test_layer_shape_arithmetic_matches_the_measured_fragments():
    """The parameter count of a layer, times 4 bytes, is the stored full fragment (plus a small file header)."""
    m = sizing.measured_model()
    header = m["full_bytes"] - m["layer_params"] * m["full_dtype_bytes"]
    assert 0 <= header < 4096, f"the shape formula misses {header:.0f} bytes of a layer"
    assert 0.5 < m["int4_bytes_per_param"] < 0.75  # 4-bit nibbles + group scales/zeros, nothing else
    assert m["kv_tokens_per_swap"] == pytest.approx((m["full_bytes"] - m["int4_bytes"]) / m["kv_bytes_per_token"])


@pytest.mark.needs_model
def test_llama3_8b_numbers():
    shape = sizing.MODELS["Llama-3.1-8B"]
    assert shape.layer_params() * shape.layers + shape.shared_params() == pytest.approx(8.03e9, rel=0.01)
    assert shape.kv_bytes_per_token(2) == 131072  # 128 KiB: 2 x 32 layers x 8 KV heads x 128 x fp16
    r = sizing.report()
    rows = {(g["model"], g["gpu"]): g for g in r["gpus"]}
    l4, h100 = rows["Llama-3.1-8B", "L4 24 GB"], rows["Llama-3.1-8B", "H100 80 GB"]
    assert l4["freed_per_swap_bytes"] == h100["freed_per_swap_bytes"]
    # The morph matters most where KV is scarce: the same swaps multiply a small pool more.
    gain = lambda g: g["kv_tokens_by_int4_layers"][g["balanced_max_int4"]] / g["kv_tokens_by_int4_layers"][0]  # noqa: E731
    assert gain(l4) > 2 > gain(h100) > 1
    assert l4["swap_prepare_s_lower"] < l4["swap_prepare_s_upper"]
    # Llama-2-7B keeps a KV head per query head: 4x the bytes per token, ~4x fewer tokens per swap.
    l2 = rows["Llama-2-7B", "L4 24 GB"]
    assert l2["kv_bytes_per_token"] == 4 * l4["kv_bytes_per_token"]


def test_trace_statistics_and_bursts(tmp_path):
    trace = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    # 100 s at 1 req/s, then 20 s at 5 req/s: one burst of 20 s.
    times = [i for i in range(100)] + [100 + i / 5 for i in range(100)]
    for s in times:
        rows.append(f"2023-11-16 18:{int(s // 60):02d}:{s % 60:09.6f},100,10")
    trace.write_text("\n".join(rows) + "\n")
    st = sizing.trace_stats(trace)
    assert st["requests"] == 200 and st["bursts"] == 1
    assert st["burst_duration_max_s"] == 20 and st["burst_mean_rate"] == pytest.approx(5.0, rel=0.1)
    assert st["prompt_mean"] == 100 and st["output_p50"] == 10


def test_cover_seconds():
    assert sizing.cover_seconds(10_000, 4, 2.0, 1000) == pytest.approx(20.0)
    assert sizing.cover_seconds(10_000, 4, 0.0, 1000) == float("inf")


@pytest.mark.needs_model
def test_bad_inputs_name_the_problem(tmp_path, capsys):
    with pytest.raises(sizing.SizingError, match="engine benchmark not found"):
        sizing.measured_swaps(tmp_path / "missing.json")
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"swap": {"prepare_s": [], "apply_s": []}}))
    with pytest.raises(sizing.SizingError, match="empty swap timings"):
        sizing.measured_swaps(bad)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"config": {}}))
    with pytest.raises(sizing.SizingError, match="hidden_size"):
        sizing.measured_model(manifest)
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    with pytest.raises(sizing.SizingError, match="expected columns"):
        sizing.trace_stats(tmp_path / "t.csv")
    assert sizing.main(["--bench", str(tmp_path / "missing.json")]) == 2
    assert "engine benchmark not found" in capsys.readouterr().err


@pytest.mark.needs_model
def test_markdown_tables():
    text = sizing.markdown(sizing.report())
    assert text.count("| Llama-3.1-8B |") == len(sizing.GPUS)
    assert "azure_llm_code_2023.csv" in text and "M = 8" in text
