"""Bad input is refused before any memory is taken, with the field named; bad fragments fail the load."""

import os

import pytest
import torch
from tests.engine_fixtures import fragment_dir, make_engine

from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.errors import FragmentError, InvalidRequest, QueueFull
from trtllm_backend.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return make_engine(max_tokens_in_paged_kv_cache=512, max_queue_size=3)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", {}, "prompt"),
        ("x " * 9000, {}, "prompt"),  # beyond the model context (8192)
        ("word " * 600, {}, "prompt"),  # beyond the whole KV pool (512 tokens)
        ("hi", {"max_tokens": 9000}, "max_tokens"),  # beyond the context
        ("hi", {"max_tokens": 600}, "max_tokens"),  # beyond the pool
    ],
)
@pytest.mark.needs_model
def test_bad_requests_name_the_field(engine, prompt, params, field):
    before = engine.pool.num_free
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(prompt, SamplingParams(**params), lambda o: None)
    assert e.value.field == field
    assert engine.pool.num_free == before and not engine.scheduler.has_work()


@pytest.mark.needs_model
def test_queue_cap_refuses_at_once_and_keeps_accepted_requests(engine):
    outs = []
    for _ in range(3):
        engine.add_request("Hello", SamplingParams(max_tokens=2), outs.append)
    with pytest.raises(QueueFull, match="max_queue_size"):
        engine.add_request("Hello", SamplingParams(max_tokens=2), outs.append)
    engine.run_until_idle()
    assert sum(o.finished for o in outs) == 3


@pytest.mark.needs_model
def test_abort_frees_blocks_within_an_iteration(engine):
    outs = []
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True), outs.append)
    engine._drain_inbox()
    engine.step()
    assert engine.pool.num_used > 0
    engine.abort(rid)
    engine._drain_inbox()
    assert engine.pool.num_used == 0 and outs[-1].finished and outs[-1].finish_reason == "abort"


@pytest.mark.needs_model
def test_stop_string_min_tokens_and_max_tokens(engine):
    text = "".join(
        o.text for o in engine.generate("The capital of France is", SamplingParams(max_tokens=10, stop=["."]))
    )
    assert text == " Paris"
    outs = list(engine.generate("The capital of France is", SamplingParams(max_tokens=5, ignore_eos=True)))
    assert outs[-1].num_output_tokens == 5 and outs[-1].finish_reason == "length"
    outs = list(engine.generate("The capital of France is", SamplingParams(max_tokens=12, min_tokens=12)))
    assert outs[-1].num_output_tokens == 12


@pytest.mark.needs_model
def test_engine_thread_serves_and_shuts_down(engine):
    engine.start()
    try:
        text = "".join(o.text for o in engine.generate("The capital of France is", SamplingParams(max_tokens=3)))
        assert text.startswith(" Paris")
    finally:
        engine.shutdown(drain_timeout_s=2)
    with pytest.raises(QueueFull):
        engine.add_request("hi", SamplingParams(), lambda o: None)


def copy_fragments(tmp_path):
    src = fragment_dir()
    dst = tmp_path / "fragments"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" or f.name.startswith("shared") or ".full." in f.name:
            os.symlink(f, dst / f.name)
    return src, dst


@pytest.mark.needs_model
def test_corrupt_fragment_fails_the_load_naming_the_file(tmp_path):
    src, dst = copy_fragments(tmp_path)
    bad = dst / "layer_007.full.safetensors"
    bad.unlink()
    data = bytearray((src / bad.name).read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(data)
    with pytest.raises(FragmentError, match="layer_007.full.safetensors: sha256 mismatch"):
        LLMEngine(EngineConfig(fragment_dir=str(dst)))


@pytest.mark.needs_model
def test_missing_fragment_fails_the_load_naming_the_file(tmp_path):
    _, dst = copy_fragments(tmp_path)
    (dst / "layer_003.full.safetensors").unlink()
    with pytest.raises(FragmentError, match="layer_003.full.safetensors: fragment file missing"):
        LLMEngine(EngineConfig(fragment_dir=str(dst)))


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(fragment_dir="x", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(fragment_dir="x", dtype="int3")
    with pytest.raises(ValueError, match="weight_dtype must be"):
        EngineConfig(fragment_dir="x", weight_dtype="int4")
    for name in ("tpot_slo_s", "ttft_slo_s"):
        for slo in (-0.1, float("nan"), float("inf"), "0.35"):
            with pytest.raises(ValueError, match=f"{name} must be"):
                EngineConfig(fragment_dir="x", **{name: slo})
    for share in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="prefill_chunk_tpot_share must be in"):
            EngineConfig(fragment_dir="x", prefill_chunk_tpot_share=share)
    with pytest.raises(ValueError, match="lm_head_activations must be auto, int8 or float32"):
        EngineConfig(fragment_dir="x", lm_head_activations="int4")
    with pytest.raises(ValueError, match="batch_scheduler_policy must be one of max_utilization, guaranteed_no_evict"):
        EngineConfig(fragment_dir="x", batch_scheduler_policy="static_batch")
    with pytest.raises(ValueError, match="kv_cache_reuse_across_morphs must be true or false"):
        EngineConfig(fragment_dir="x", kv_cache_reuse_across_morphs="yes")
    for dtype, weight_dtype in (("bfloat16", "float16"), ("float16", "float32")):
        with pytest.raises(ValueError, match=f"weight_dtype={weight_dtype} with dtype={dtype}"):
            EngineConfig(fragment_dir="x", dtype=dtype, weight_dtype=weight_dtype)
    assert EngineConfig(fragment_dir="x", weight_dtype="float16").weight_torch_dtype == torch.float16
    assert EngineConfig(fragment_dir="x", weight_dtype="bfloat16").weight_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight_dtype=bfloat16 with dtype=float16: weights are stored in the compute"):
        EngineConfig(fragment_dir="x", dtype="float16", weight_dtype="bfloat16")
