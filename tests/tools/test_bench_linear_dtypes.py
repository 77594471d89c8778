"""tools.bench_linear_dtypes: the three paths timed at every row count asked for, written as JSON."""

import json

from tools import bench_linear_dtypes


def test_every_path_is_timed_at_each_row_count(tmp_path, capsys):
    out = tmp_path / "l.json"
    assert bench_linear_dtypes.main(["--rows", "1", "3", "--reps", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["rows"] for r in got["rows"]] == [1, 3]
    for r in got["rows"]:
        assert r["fp16_weights_fp32"] > 0 and r["bf16_weights_engine"] > 0 and r["bf16"] > 0
        assert abs(r["fp32_over_bf16"] - r["fp16_weights_fp32"] / r["bf16"]) < 1e-9
        assert abs(r["fp16_over_bf16_weights"] - r["fp16_weights_fp32"] / r["bf16_weights_engine"]) < 1e-9
    assert "fp16 / bf16 weights" in capsys.readouterr().out
