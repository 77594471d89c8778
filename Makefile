# Every target does any missing set-up first (tools/setup.sh is idempotent).
SHELL := /bin/bash
export OMP_WAIT_POLICY := PASSIVE
PY := .venv/bin/python

.PHONY: setup serve generate test bench
setup:
	@bash tools/setup.sh

serve: setup
	$(PY) -m trtllm_backend.serve

generate: setup
	$(PY) -m trtllm_backend.generate "The capital of France is"

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) tools/bench_engine.py
