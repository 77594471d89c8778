"""Kernel numerics per engine (trtllm_backend/kernel_numerics.py): resolved once, put in force before every
iteration, so another engine or a tool flipping a process-wide switch cannot change what an engine computes."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels, int8_linear, quant_matmul
from trtllm_backend.kernel_numerics import KernelNumerics


def _restore_switches():
    return (
        quant_matmul.int4_activations_in_force(),
        quant_matmul.int4_prefill_in_force(),
        int8_linear.head_activations(),
    )


@pytest.fixture
def switches():
    before = _restore_switches()
    yield
    if before[0] is not None:
        quant_matmul.set_int4_activations(before[0])
        quant_matmul.set_int4_prefill(before[1])
    int8_linear.set_head_activations(before[2])


def test_resolved_leaves_no_auto_and_keeps_explicit_names():
    r = KernelNumerics("int8", "auto", "auto").resolved()
    assert "auto" not in (r.int4_activations, r.int4_prefill, r.lm_head_activations)
    assert KernelNumerics("float32", "bfloat16", "float32").resolved() == KernelNumerics(
        "float32", "bfloat16", "float32"
    )
    # auto's prefill is decode only with int8 activations: float32 activations never resolve to the decode tiles
    assert KernelNumerics("float32", "auto", "auto").resolved().int4_prefill != "decode"


@pytest.mark.parametrize(
    "bad, match",
    [
        (KernelNumerics("int4"), "int4_activations"),
        (KernelNumerics(int4_prefill="fp8"), "int4_prefill"),
        (KernelNumerics(lm_head_activations="bf16"), "lm_head_activations"),
    ],
)
def test_bad_names_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        bad.resolved()


def test_put_in_force_sets_what_was_flipped_and_is_a_no_op_after(switches):
    mine = KernelNumerics("int8", "float32", "float32").resolved()
    mine.put_in_force()
    assert mine.put_in_force() is False  # already in force: nothing set
    int8_linear.set_head_activations("int8")  # someone else flips a switch
    if cpu_kernels.ops() is not None:
        quant_matmul.set_int4_activations("float32")
        assert KernelNumerics.in_force() != mine
    assert mine.put_in_force() is True
    assert int8_linear.head_activations() == "float32"
    if cpu_kernels.ops() is not None:
        assert KernelNumerics.in_force() == mine
    else:
        assert KernelNumerics.in_force() is None  # no INT4 switches without the kernels


@pytest.mark.needs_model
def test_a_second_engine_does_not_change_what_the_first_computes(switches):
    from tests.engine_fixtures import fragment_dir
    from trtllm_backend.config import EngineConfig
    from trtllm_backend.engine import LLMEngine
    from trtllm_backend.sampling import SamplingParams

    if cpu_kernels.ops() is None:
        pytest.skip("no C++ kernels: run make setup")

    def build(activations: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                fragment_dir=str(fragment_dir()),
                morph_policy="int4",
                num_threads=1,
                max_tokens_in_paged_kv_cache=512,
                int4_activations=activations,
            )
        )

    def logits_of(engine: LLMEngine) -> torch.Tensor:
        got = []
        engine.add_request(
            "The capital of France is", SamplingParams(max_tokens=4, logprobs=1), lambda out: got.append(out)
        )
        engine.run_until_idle()
        return torch.tensor([lp.logprob for o in got for lp in o.logprobs], dtype=torch.float64)

    first = build("int8")
    alone = logits_of(first)
    second = build("float32")  # built last: its numerics are the process's switches now
    assert KernelNumerics.in_force() == second.numerics != first.numerics
    assert torch.equal(logits_of(first), alone)  # bitwise: the first engine put its own numerics back
    assert KernelNumerics.in_force() == first.numerics
    assert not torch.equal(logits_of(second), alone)  # the two numerics do differ, so the check above can fail
    assert KernelNumerics.in_force() == second.numerics
