"""Shared helpers for engine tests: the real fragment set, lone/batched greedy runs, the near-tie rule."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engines.build_fragments import default_fragment_dir, fragments_ok
from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.sampling import SamplingParams

NEAR_TIE = 1e-3

PROMPTS = [
    "The capital of France is",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are red, yellow and",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to unite some of the best blessings of existence; and had lived nearly twenty-one years in the world",
    "Water boils at a temperature of",
    "List of fruits: apple, banana,",
]


def fragment_dir() -> Path:
    """The embedded model's fragments, or another set named by MORPHSERVE_TEST_FRAGMENTS."""
    d = Path(os.environ.get("MORPHSERVE_TEST_FRAGMENTS") or default_fragment_dir())
    assert fragments_ok(d), f"fragments missing in {d}: run `make setup` (tools/setup.sh) first"
    return d


def damaged_fragment_copy(dst: Path, damage: str = "corrupt") -> tuple[Path, int]:
    """The fragment set's layers (symlinks; the manifest without the head unit) with the first swap candidate's INT4
    file corrupted (one byte flipped) or missing; returns the folder and that layer."""
    from trtllm_backend.manifest import HEAD_UNIT, MANIFEST, Manifest, write_manifest
    from trtllm_backend.precision import Precision

    if damage not in ("corrupt", "missing"):
        raise ValueError(f"damage must be 'corrupt' or 'missing', not {damage!r}")
    src = fragment_dir()
    dst.mkdir()
    m = Manifest(src)
    layer = m.swap_order()[0]
    victim = m.fragment(layer, Precision.INT4)["file"]
    for f in src.iterdir():
        if f.is_file() and f.name not in (victim, MANIFEST):
            os.symlink(f, dst / f.name)
    write_manifest(dst, {k: v for k, v in m.data.items() if k != HEAD_UNIT})
    if damage == "corrupt":
        data = bytearray((src / victim).read_bytes())
        data[100] ^= 0xFF
        (dst / victim).write_bytes(data)
    return dst, layer


def layers_only_copy(dst: Path) -> Path:
    """The fragment set as it was before the embedding / LM head unit (its files linked, the manifest without
    "lm_head"), for tests whose swap counts and byte arithmetic are about layers (the head: test_head_unit.py)."""
    from engines.build_fragments import link_set
    from trtllm_backend.manifest import HEAD_UNIT, Manifest, write_manifest

    link_set(fragment_dir(), dst)
    data = Manifest(dst).data
    data.pop(HEAD_UNIT, None)
    write_manifest(dst, data)
    return dst


def make_engine(**overrides) -> LLMEngine:
    # Static full precision unless a test asks otherwise: outputs are compared with full-precision references.
    overrides.setdefault("morph_policy", "full")
    # Whole prefill chunks unless a test asks otherwise: the stall-free cut (step_budget.py) follows measured step
    # times, and tests that count iterations (forced morphs, drains) need a schedule that does not depend on the
    # machine's speed. The cut has its own tests (test_step_budget.py, test_engine_batching.py) and the servers
    # the suite starts run with it on.
    overrides.setdefault("prefill_chunk_tpot_share", 0.0)
    overrides.setdefault("fragment_dir", str(fragment_dir()))
    return LLMEngine(EngineConfig(**overrides))


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def run_greedy(
    engine: LLMEngine, prompts: list[str], max_tokens: int
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """All prompts submitted together (one batch); returns tokens and top-2 gaps per request id."""
    tokens: dict[str, list[int]] = {}
    gaps: dict[str, list[float]] = {}
    engine.on_logits = lambda rid, row: gaps.setdefault(rid, []).append(top2_gap(row))
    for i, p in enumerate(prompts):
        rid = f"p{i}"
        tokens[rid] = []
        engine.add_request(
            p,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            lambda o, rid=rid: tokens[rid].extend(o.token_ids),
            request_id=rid,
        )
    engine.run_until_idle()
    engine.on_logits = None
    return tokens, gaps


def assert_same_up_to_near_tie(lone: list[int], lone_gaps: list[float], other: list[int]) -> None:
    """Equal, or the first difference comes at a position where the lone run's top-2 logits were a near tie.

    Only the gap at the first difference can excuse it: the tokens before it are identical, so a near tie
    earlier was resolved the same way in both runs and cannot explain a later divergence."""
    assert len(lone) == len(other) == len(lone_gaps), (len(lone), len(other), len(lone_gaps))
    for i, (a, b) in enumerate(zip(lone, other)):
        if a != b:
            assert lone_gaps[i] < NEAR_TIE, (
                f"diverged at token {i} where the top-2 gap was {lone_gaps[i]:.2e} (>= {NEAR_TIE})"
            )
            return


def random_layer_tensors(cfg, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A decoder layer's full-precision tensors for `cfg` (HF names, unfused), random from `g`."""
    hid, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "self_attn.q_proj": (cfg.num_heads * D, hid),
        "self_attn.k_proj": (cfg.num_kv_heads * D, hid),
        "self_attn.v_proj": (cfg.num_kv_heads * D, hid),
        "self_attn.o_proj": (hid, cfg.num_heads * D),
        "mlp.gate_proj": (inter, hid),
        "mlp.up_proj": (inter, hid),
        "mlp.down_proj": (hid, inter),
    }
    t = {f"{k}.weight": torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    t.update(
        {n: torch.rand(hid, generator=g) + 0.5 for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    )
    return t
