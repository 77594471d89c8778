"""trtllm_backend/triton, the launcher (trtllm_backend/serve.py) and the tests against a real tritonserver."""
