#!/usr/bin/env bash
# Calibration extras (NVIDIA ModelOpt for AWQ) installed into the server venv .venv, idempotently.
# NOTE: the constraints pin numpy/torch/transformers to the server's versions, so ModelOpt can never
# pull numpy 2 (the Triton Python stub needs numpy < 2) or a CUDA torch build into .venv; the install
# fails instead. `pip install --dry-run` showed it adds only PuLP, ninja, nvidia-ml-py, omegaconf, scipy.
# Override the venv with CALIB_VENV=.venv-calib to keep them apart (same pins apply).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CALIB_VENV:-.venv}
PY=${PYTHON:-python3}
PKGS=(nvidia-modelopt==0.47.0 requests==2.34.2 huggingface_hub==1.33.0 scipy==1.17.1)
STAMP="$VENV/.calib-stamp"
want=$(cat tools/setup_calib.sh | sha256sum | cut -d' ' -f1)
[ -f "$STAMP" ] && [ "$(cat "$STAMP")" == "$want" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
printf '%s\n' numpy==1.26.4 torch==2.13.0 transformers==5.14.1 > "$pins"
echo "[setup_calib] installing ModelOpt into $VENV"
"$VENV/bin/pip" install -q -c "$pins" "${PKGS[@]}" numpy==1.26.4 torch==2.13.0 transformers==5.14.1 \
  accelerate==1.15.0 safetensors==0.8.0 gguf==0.19.0 tokenizers==0.22.2 tqdm==4.70.1
"$VENV/bin/python" - <<'PY'
import numpy, torch, modelopt
assert numpy.__version__ == "1.26.4", numpy.__version__
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"[setup_calib] modelopt {modelopt.__version__}, numpy {numpy.__version__}, torch {torch.__version__}")
PY
echo "$want" > "$STAMP"
