"""tools/microbench/decode_attention.py's bit-for-bit comparison of two builds' outputs (here: one build twice)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from plugins import cpu_kernels
from tools.microbench import decode_attention


@pytest.mark.skipif(cpu_kernels.ops() is None, reason="the C++ kernels are not built: run make setup")
def test_a_build_compared_with_itself_is_bitwise_equal_and_a_changed_output_is_named(tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    decode_attention.main(["--dump", str(a)])
    decode_attention.main(["--dump", str(b)])
    assert decode_attention.main(["--compare", str(a), str(b)]) == 0
    assert "40 cases, 0 differ" in capsys.readouterr().out
    outs = load_file(b)
    key = next(iter(outs))
    outs[key] = outs[key].clone()
    outs[key].view(-1)[0] += 1e-6
    save_file(outs, b)
    assert decode_attention.main(["--compare", str(a), str(b)]) == 1
    assert key in capsys.readouterr().out
