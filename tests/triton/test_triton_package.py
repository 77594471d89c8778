"""trtllm_backend.triton is a layer on top of the engine: the engine core imports nothing from it, and the
launcher's side of it (parameters, discovery, lifecycle) loads without torch."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import trtllm_backend

TRITON_SIDE = ("trtllm_backend.triton", "trtllm_backend.serve")


def _modules_loaded_by(imports: list[str]) -> list[str]:
    code = (
        f"import importlib, json, sys\nfor m in {imports!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_engine_core_does_not_import_the_triton_package():
    # The core is the package's own modules; subpackages (triton/, openai/) are applications on top of it.
    core = [
        f"trtllm_backend.{m.name}"
        for m in pkgutil.iter_modules(trtllm_backend.__path__)
        if not m.ispkg and not f"trtllm_backend.{m.name}".startswith(TRITON_SIDE)
    ]
    assert "trtllm_backend.engine" in core
    loaded = _modules_loaded_by(core)
    assert [m for m in loaded if m.startswith(TRITON_SIDE)] == []


def test_the_launcher_side_loads_without_torch():
    loaded = _modules_loaded_by(["trtllm_backend.serve", "trtllm_backend.triton.params"])
    assert "trtllm_backend.triton.server" in loaded and "torch" not in loaded
