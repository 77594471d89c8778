"""OpenAI-compatible gateway: its own process in front of the Triton server, forwarding over gRPC streaming.

`python -m trtllm_backend.openai --triton localhost:8001 --port 9000`. Triton's own OpenAI frontend runs the
server in process through bindings the CPU server does not ship, hence a separate gateway (docs/architecture.md,
"Serving surfaces").
"""
