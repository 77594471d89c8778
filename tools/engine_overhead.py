"""The engine's own time per decode step outside the model: step minus `model.forward`, paired within each
step, median of 40 steps after prefill, at batch 1 and 16, full precision and all-INT4 (fp16-stored, one
thread). Run from the checkout to measure (cwd first on sys.path); alternate two checkouts to compare them:

    OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=200000 python -m tools.engine_overhead
"""

from __future__ import annotations

import statistics
import time

from engines.build_fragments import default_fragment_dir
from trtllm_backend.config import EngineConfig
from trtllm_backend.engine import LLMEngine
from trtllm_backend.sampling import SamplingParams


def overhead(policy: str, batches=(1, 16), steps: int = 40) -> list[str]:
    eng = LLMEngine(
        EngineConfig(
            fragment_dir=default_fragment_dir(),
            morph_policy=policy,
            max_batch_size=max(batches),
            weight_dtype="float16",
            num_threads=1,
        )
    )
    eng.settle_morph()
    fwd: list[float] = []
    forward = eng.model.forward

    def timed(*a, **k):
        t = time.perf_counter()
        out = forward(*a, **k)
        fwd.append(time.perf_counter() - t)
        return out

    eng.model.forward = timed
    lines = []
    for b in batches:
        for i in range(b):
            eng.add_request(
                f"Chapter {i}. It was a bright cold day in April, and the clocks were striking",
                SamplingParams(max_tokens=steps + 20, ignore_eos=True),
                lambda o: None,
            )
        eng.step()
        while any(r.num_computed < len(r.prompt_ids) for r in eng.requests.values()):
            eng.step()
        for _ in range(3):
            eng.step()
        total, outside = [], []
        for _ in range(steps):
            fwd.clear()
            t = time.perf_counter()
            eng.step()
            total.append(time.perf_counter() - t)
            outside.append(total[-1] - fwd[0])
        lines.append(
            f"{policy} b{b}: step {statistics.median(total) * 1e3:.2f} ms, outside forward "
            f"{statistics.median(outside) * 1e3:.3f} ms"
        )
        eng.abort_all()
    return lines


def main() -> int:
    print(" | ".join(line for policy in ("full", "int4") for line in overhead(policy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
