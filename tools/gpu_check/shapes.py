"""The model shapes the check runs at, and the workload each section gives them.

Random weights stand in for a checkpoint: decode speed, memory and morphing depend on the shapes, not the values.
The tiny shape is what the CPU tests run (every section, in seconds); the two real shapes are for a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_backend.manifest import ModelConfig

EOS_ID = 1  # the synthetic tokenizer's end-of-sequence token (synth.tokenizer)


@dataclass(slots=True, frozen=True)
class Shape:
    name: str
    config: ModelConfig
    group_size: int  # INT4 group (must divide every input dim; the CUDA INT4 kernel takes 32, 64, 128 or 256)
    file_dtype: torch.dtype  # of the full-precision fragment files
    # swaps: requests decoding while every layer is swapped down and restored, and their context
    swap_batch: int
    swap_context: int
    # burst: requests arriving at once, prompt and output tokens each, and the deliberately small KV pool (tokens)
    burst_requests: int
    burst_prompt: int
    burst_output: int
    burst_kv_tokens: int

    def describe(self) -> dict:
        c = self.config
        return {
            "name": self.name,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_layers": c.num_layers,
            "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "tied_embeddings": c.tie_word_embeddings,
            "int4_group_size": self.group_size,
            "file_dtype": str(self.file_dtype).removeprefix("torch."),
        }


def _config(hidden, inter, layers, heads, kv_heads, head_dim, vocab, max_pos, theta, tied) -> ModelConfig:
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=EOS_ID,
    )


SHAPES = {
    # Every section on the CPU in seconds; the exactness check's config on every device.
    "tiny": Shape(
        "tiny",
        _config(128, 256, 4, 4, 2, 32, 512, 1024, 10000.0, True),
        32,
        torch.float32,
        swap_batch=4,
        swap_context=400,
        burst_requests=24,
        burst_prompt=24,
        burst_output=24,
        burst_kv_tokens=128,
    ),
    # SmolLM2-135M (the embedded model): 576 rules out group 128.
    "smollm2-135m": Shape(
        "smollm2-135m",
        _config(576, 1536, 30, 9, 3, 64, 49152, 8192, 100000.0, True),
        32,
        torch.float16,
        swap_batch=16,
        swap_context=2048,
        burst_requests=64,
        burst_prompt=256,
        burst_output=128,
        burst_kv_tokens=2048,
    ),
    # Llama-3.1-8B: 16 GB of fp16 weights; its 128k context is cut to 8k (RoPE tables only: the speed is the same).
    "llama-3.1-8b": Shape(
        "llama-3.1-8b",
        _config(4096, 14336, 32, 32, 8, 128, 128256, 8192, 500000.0, False),
        128,
        torch.float16,
        swap_batch=8,
        swap_context=4096,
        burst_requests=64,
        burst_prompt=256,
        burst_output=128,
        burst_kv_tokens=2048,
    ),
}
EXACTNESS_SHAPE = "tiny"
DEFAULT_SHAPES = ("smollm2-135m", "llama-3.1-8b")


def parse_shapes(text: str) -> list[Shape]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"--shapes: unknown {unknown or 'none given'} (known: {', '.join(SHAPES)})")
    return [SHAPES[n] for n in names]
