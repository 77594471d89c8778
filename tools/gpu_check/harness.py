"""What every section does with an engine: build it on the device, see where its tensors live, count what a decode
step reads, collect its outputs, and let it go."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.outputs import RequestOutput

from . import device as dev


def make_engine(fragment_dir, device: str, threads: int | None, **overrides) -> tuple[LLMEngine, float]:
    """The engine on `device` with `overrides` (EngineConfig fields), and the seconds it took to load."""
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(fragment_dir=str(fragment_dir), device=device, num_threads=threads, **overrides))
    dev.sync(device)
    return engine, time.perf_counter() - t


def close(engine: LLMEngine, device: str) -> None:
    engine.shutdown(drain_timeout_s=0.0)
    engine.model.slots.clear()  # NOTE: the caller's reference may outlive this call; the weights should not
    dev.release(device)


def placement(engine: LLMEngine) -> dict:
    """The devices the engine's tensors are on, by part, with how many tensors each: on a CUDA engine everything
    should be on cuda."""

    def where(tensors) -> dict:
        return dict(Counter(t.device.type for t in tensors))

    layers = []
    for s in engine.model.slots:
        w = s.weights
        layers += [w.input_layernorm, w.post_attention_layernorm]
        for op in (w.qkv, w.o, w.gate_up, w.down):
            layers += op.resident_tensors() if hasattr(op, "resident_tensors") else [getattr(op, "weight")]
    head = engine.model.head
    tables = [t for t in (head.table, head.untied) if t is not None]
    return {
        "layers": where(layers),
        "embedding_and_head": where(getattr(t, "weight", t) for t in tables),
        "final_norm": where([engine.model.norm]),
        "rope_tables": where([engine.model.cos, engine.model.sin]),
        "kv_cache": where(seg.kv for seg in engine.pool.segments),
    }


def placement_ok(found: dict, device: str) -> bool:
    return all(set(parts) == {device} for parts in found.values())


def weights_read_per_step(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads: every layer as bound, the final norm and the LM head table (the
    embedding lookup reads a few rows only)."""
    m = engine.model
    head = m.head.untied if m.head.untied is not None else m.head.table
    return sum(s.weights.nbytes for s in m.slots) + m.norm.numel() * m.norm.element_size() + head.nbytes


@dataclass
class Outputs:
    """Per request: its tokens, and its last output (timings, finish reason)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    final: dict[str, RequestOutput] = field(default_factory=dict)

    def callback(self, rid: str, on_finish=None):
        self.tokens[rid] = []

        def on_output(out: RequestOutput) -> None:
            self.tokens[rid].extend(out.token_ids)
            if out.finished:
                self.final[rid] = out
                if on_finish is not None:
                    on_finish(out)

        return on_output

    def errors(self) -> dict[str, str]:
        return {rid: o.error or "" for rid, o in self.final.items() if o.finish_reason == "error"}
