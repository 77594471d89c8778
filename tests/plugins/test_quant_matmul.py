"""INT4/INT8 weight-only operators: kernels vs dequantized references, portable format, fusion, bytes."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from plugins.quant_matmul import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

torch.manual_seed(0)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def weight():
    return torch.randn(960, 576) * 0.02


@pytest.mark.parametrize("group_size", [64, 32])
def test_int4_kernel_matches_dequantized_reference(weight, group_size):
    t = quantize_int4(weight, group_size)
    x = torch.randn(5, 576)
    y = Int4Linear(t)(x)
    assert y.dtype == torch.float32 and y.shape == (5, 960)
    # Only the bf16 cast of the activations separates the kernel from the fp32 reference.
    assert rel_err(y, x @ dequantize_int4(t).t()) < 1e-2
    # And the int4 grid itself is a fair approximation of the weight (random normal: ~8% at G=64).
    assert rel_err(y, x @ weight.t()) < 0.12


def test_int4_error_is_within_half_a_step(weight):
    t = quantize_int4(weight, 64)
    step = t["scales_zeros"][..., 0].float().t().repeat_interleave(64, 1)
    assert ((dequantize_int4(t) - weight).abs() <= step * 0.5 + 1e-3 * weight.abs().max()).all()


def test_int4_pre_scale_is_exact_in_the_reference(weight):
    s = torch.rand(576) + 0.5
    t = quantize_int4(weight, 64, pre_scale=s)
    x = torch.randn(3, 576)
    assert rel_err(Int4Linear(t)(x), x @ dequantize_int4(t).t()) < 1e-2
    assert rel_err(dequantize_int4(t), weight) < 0.15  # a random pre-scale helps no one: a bit worse


def test_portable_format_round_trip(weight, tmp_path):
    t = quantize_int4(weight, 64, pre_scale=torch.rand(576) + 0.5, prefix="qkv.")
    assert t["qkv.qweight"].dtype == torch.uint8 and t["qkv.qweight"].shape == (960, 288)
    assert t["qkv.scales_zeros"].dtype == torch.bfloat16 and t["qkv.scales_zeros"].shape == (9, 960, 2)
    save_file(t, tmp_path / "f.safetensors")
    back = load_file(tmp_path / "f.safetensors")
    assert all(torch.equal(back[k], v) for k, v in t.items())
    x = torch.randn(4, 576)
    assert torch.equal(Int4Linear.from_tensors(back, "qkv.")(x), Int4Linear(t, "qkv.")(x))
    q = torch.randint(0, 16, (8, 64), dtype=torch.int32)
    packed = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)
    assert torch.equal(unpack_int4(packed), q)


def test_fused_projection_equals_separate():
    ws = [torch.randn(n, 576) * 0.02 for n in (576, 192, 192)]
    x = torch.randn(7, 576)
    fused = Int4Linear.fused(ws)(x)
    separate = torch.cat([Int4Linear.from_float(w)(x) for w in ws], -1)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)


def test_leading_dims_and_bad_group_size(weight):
    op = Int4Linear.from_float(weight)
    x = torch.randn(2, 3, 576)
    torch.testing.assert_close(op(x), op(x.reshape(6, 576)).reshape(2, 3, 960))
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(8, 576), 128)


def test_resident_bytes(weight):
    fp32 = weight.numel() * 4
    # 4 bits + a bf16 (scale, zero) pair per group: 0.5625 B/weight at G=64 (0.14x fp32, 0.28x fp16),
    # 0.625 B/weight at G=32 (0.156x fp32).
    assert 0.140 <= Int4Linear.from_float(weight, 64).nbytes / fp32 < 0.141
    assert 0.156 <= Int4Linear.from_float(weight, 32).nbytes / fp32 < 0.157
    assert 0.25 <= Int8Linear.from_float(weight).nbytes / fp32 < 0.26


def test_int8_kernel_matches_dequantized_reference(weight):
    t = quantize_int8(weight, prefix="down.")
    x = torch.randn(9, 576)
    y = Int8Linear.from_tensors(t, "down.")(x)
    assert rel_err(y, x @ dequantize_int8(t, "down.").t()) < 1e-2
    assert rel_err(y, x @ weight.t()) < 2e-2
