"""tools/bench_engine.py's interleaved policy comparison, on the real fragment set (tiny: 2 rounds of 2 steps)."""

from __future__ import annotations

import argparse

import pytest

from tests.engine_fixtures import fragment_dir
from tools import bench_engine


def _args(**kw) -> argparse.Namespace:
    base = dict(
        fragment_dir=str(fragment_dir()),
        batches=[1, 3],
        policy=["full", "int4"],
        threads=1,
        int4_prefill="auto",
        weight_dtype="float16",
        context=0,
        kv_cache_dtype="auto",
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.needs_model
def test_interleaved_policies_time_every_policy_per_round_and_give_the_ratio_with_its_range():
    out = bench_engine.interleaved_policies(_args(), rounds=2, steps=2)
    assert [row["batch"] for row in out["batches"]] == [1, 3]
    for row in out["batches"]:
        assert set(row["step_s"]) == {"full", "int4"} and all(t > 0 for t in row["step_s"].values())
        assert len(row["bandwidth_GBps"]) == 2
        r = row["tok_s_over_first"]["int4"]
        assert r["low"] <= r["median"] <= r["high"]
        assert list(row["tok_s_over_first"]) == ["int4"]  # no ratio of the first policy to itself
    b1 = out["batches"][0]
    assert set(b1["share_of_floor"]) == {"full", "int4"} and all(0 < v for v in b1["share_of_floor"].values())
    assert "share_of_floor" not in out["batches"][1]


@pytest.mark.needs_model
def test_interleaving_refuses_policies_whose_suffix_sets_process_wide_kernel_settings():
    with pytest.raises(SystemExit, match="process-wide"):
        bench_engine.interleaved_policies(_args(policy=["full", "int4@avx2"]), rounds=1)


@pytest.mark.needs_model
def test_prefill_ab_times_both_int4_prefill_paths_and_restores_the_engines_numerics():
    engine = bench_engine.make_engine(_args(policy=["int4"]), "int4")
    before = engine.numerics
    rows = bench_engine.prefill_ab(engine, reps=1, long=96, streams=3, short=40)
    assert engine.numerics == before and before.in_force() in (before, None)  # put back as found
    assert [r["prompts"] for r in rows] == ["1 x 96", "3 x 40"]
    assert rows[0]["tokens"] >= 90 and rows[1]["tokens"] >= 3 * 36  # re-encoded pieces may merge a token or two
    assert all(r["bfloat16_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)


@pytest.mark.needs_model
def test_prefetch_ab_times_both_settings_and_puts_the_built_in_distance_back():
    from plugins import cpu_kernels

    if cpu_kernels.ops() is None:
        pytest.skip("no C++ kernels: run make setup")
    engine = bench_engine.make_engine(_args(policy=["int4"]), "int4")
    rows = bench_engine.ab_table(engine, [1, 2], bench_engine.use_prefetch, "INT4 prefetch A/B", "off", "on", steps=2)
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["off_step_s"] > 0 and r["on_step_s"] > 0 for r in rows)
    assert cpu_kernels.ops().int4_prefetch(-1) == bench_engine.DEFAULT_PREFETCH > 0


@pytest.mark.needs_model
def test_dense_prefetch_ab_times_both_settings_and_leaves_it_on():
    from plugins import cpu_kernels

    if cpu_kernels.ops() is None:
        pytest.skip("no C++ kernels: run make setup")
    engine = bench_engine.make_engine(_args(policy=["full"]), "full")
    rows = bench_engine.ab_table(
        engine, [1, 3], bench_engine.use_dense_prefetch, "dense prefetch A/B", "off", "on", steps=2
    )
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["off_step_s"] > 0 and r["on_step_s"] > 0 for r in rows)
    assert cpu_kernels.ops().dense_prefetch(-1) == 1


@pytest.mark.needs_model
def test_a_long_context_step_counts_its_cached_kv_and_the_kv_prefetch_ab_leaves_it_on():
    import torch

    from plugins import cpu_kernels

    if cpu_kernels.ops() is None:
        pytest.skip("no C++ kernels: run make setup")
    engine = bench_engine.make_engine(_args(policy=["int4"], threads=2, kv_cache_dtype="float16"), "int4")
    assert engine.pool.dtype == torch.float16  # the served default pool, asked for
    step, kv = bench_engine.decode_step_time(engine, 1, steps=2, context=90)
    per_token = engine.pool.bytes_per_block // engine.pool.block_size
    assert per_token == 2 * 30 * 2 * 3 * 64  # fp16 K and V of SmolLM2's 30 layers, 3 KV heads of 64
    assert step > 0 and 85 * per_token <= kv <= 91 * per_token  # the prompt's tokens (re-encoding may merge a few)
    rows = bench_engine.ab_table(
        engine, [1, 2], bench_engine.use_kv_prefetch, "K/V prefetch A/B", "off", "on", steps=2, context=90
    )
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["off_step_s"] > 0 and r["on_step_s"] > 0 for r in rows)
    assert cpu_kernels.ops().kv_prefetch(-1) == 1


@pytest.mark.needs_model
def test_a_batch_whose_prompts_do_not_decode_together_in_the_pool_is_refused():
    from trtllm_backend.config import EngineConfig
    from trtllm_backend.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            fragment_dir=str(fragment_dir()),
            morph_policy="full",
            max_batch_size=3,
            max_tokens_in_paged_kv_cache=256,
            num_threads=1,
        )
    )
    with pytest.raises(SystemExit, match="of 3 requests decode together"):
        bench_engine.start_decode(engine, 3, max_tokens=4, context=100)
    assert not engine.requests  # aborted, nothing left running


def test_read_bandwidth_on_one_thread_keeps_the_engine_threads():
    import torch

    before = torch.get_num_threads()
    assert bench_engine.read_bandwidth(threads=1) > 0
    assert torch.get_num_threads() == before
