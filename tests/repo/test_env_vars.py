"""The registry of environment variables (trtllm_backend/env_vars.py): every `MORPHSERVE_*` name that the code,
the scripts and the Docker files use is in it and in the generated table of docs/configuration.md, and every
name in it is used somewhere. Model-free, seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from trtllm_backend import env_vars
from trtllm_backend.env_vars import ALL, BY_NAME, EnvVar

from tests import ROOT

SKIP_DIRS = {".git", "build", "fragments", "__pycache__", "results", "docs", "node_modules"}
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".pbtxt", ".cpp", ".h", ".json"}
NAMES = {"Makefile", "Dockerfile", "Dockerfile.gpu"}
# A MORPHSERVE_ name, whole: not the stem of a brace pattern such as MORPHSERVE_REPLICA{1,2}_HTTP_PORT in a comment.
NAME = re.compile(r"MORPHSERVE_[A-Z0-9_]*[A-Z0-9](?![{\w])")
# MORPHSERVE_ names in the code that are not environment variables.
NOT_ENV = {"MORPHSERVE_HEADERS"}  # a C preprocessor macro: plugins/cpu_kernels.py compiles with -DMORPHSERVE_HEADERS
THIS = Path(__file__).resolve()
REGISTRY = Path(env_vars.__file__).resolve()


def code_files() -> list[Path]:
    """The code, scripts and Docker / deployment files of the repository (not the docs, not the results)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")]
        for f in files:
            p = Path(folder) / f
            if (p.suffix in SUFFIXES or f in NAMES) and p.resolve() not in (THIS, REGISTRY):
                found.append(p)
    return sorted(found)


CODE = {p: p.read_text(errors="replace") for p in code_files()}


def constants() -> dict[str, EnvVar]:
    return {k: v for k, v in vars(env_vars).items() if isinstance(v, EnvVar)}


def test_the_scan_sees_the_code():
    rel = {str(p.relative_to(ROOT)) for p in CODE}
    assert {
        "Makefile",
        "docker/compose.yaml",
        "docker/test_compose.sh",
        "plugins/cpu_kernels.py",
        "trtllm_backend/serve.py",
        "tests/triton/test_fuzz_server.py",
    } <= rel


def test_every_name_in_the_code_is_in_the_registry():
    found = {m for text in CODE.values() for m in NAME.findall(text)} - NOT_ENV
    missing = sorted(found - BY_NAME.keys())
    assert missing == [], "add these to trtllm_backend/env_vars.py (one line each), then regenerate the docs table"


def test_every_name_in_the_registry_is_used():
    """Used: spelled out in the code (a shell or Compose file, the kernels, a test) or read through the registry."""
    text = "\n".join(CODE.values())
    unused = sorted(
        v.name
        for const, v in constants().items()
        if v.name not in text and not re.search(rf"\benv_vars\.{const}\b", text)
    )
    assert unused == [], "nothing reads these: remove them from trtllm_backend/env_vars.py"


def test_names_are_unique_and_every_entry_is_a_constant():
    assert len(BY_NAME) == len(ALL)
    assert sorted(v.name for v in constants().values()) == sorted(BY_NAME)
    assert all(v.meaning and v.read_by and v.where for v in ALL)


def test_the_files_named_as_readers_exist():
    for v in ALL:
        for path in re.findall(r"[\w/.-]+\.(?:py|sh|yaml)\b|docker/Dockerfile(?:\.gpu)?\b", v.where):
            assert (ROOT / path).exists(), f"{v.name}: {path} does not exist"


def test_docs_table_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert env_vars.markdown_table() in doc, "regenerate: python -m trtllm_backend.env_vars"
    listed = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", doc, re.M))
    assert BY_NAME.keys() <= listed


def test_value_falls_back_to_the_default_when_unset_or_empty():
    assert env_vars.FUSED_DECODE.value({}) == "1"
    assert env_vars.FUSED_DECODE.value({"MORPHSERVE_FUSED_DECODE": ""}) == "1"
    assert env_vars.FUSED_DECODE.value({"MORPHSERVE_FUSED_DECODE": "0"}) == "0"
    assert env_vars.TRITON_ADDRESS.value({}) == ""


def test_the_registry_imports_without_torch():
    code = "import sys, trtllm_backend.env_vars; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
