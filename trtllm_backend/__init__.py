"""MorphServe backend: an elastic LLM serving engine for Triton Inference Server."""
