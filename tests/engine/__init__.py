"""The engine core of trtllm_backend: scheduling, KV cache, prefix cache, morphing, memory, sampling, outputs."""
