"""trtllm_backend/openai: the OpenAI-compatible gateway, alone and in front of a real tritonserver."""
