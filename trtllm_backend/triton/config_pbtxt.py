"""A model's `config.pbtxt` parameters: read them, edit them, serve an edited copy of the repository.

Only the `parameters { key: ... value: { string_value: ... } }` entries are touched; the rest of the file is
kept byte for byte (no protobuf round trip that would drop comments).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from . import params as triton_params

_PARAM_RE = re.compile(
    r'parameters\s*:?\s*\{\s*key\s*:\s*"(?P<key>[^"]+)"\s*'
    r'value\s*:?\s*\{\s*string_value\s*:\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*\}\s*\}'
)


def read_parameters(pbtxt: str) -> dict[str, str]:
    return {m["key"]: _unescape(m["value"]) for m in _PARAM_RE.finditer(pbtxt)}


def set_parameters(pbtxt: str, updates: dict[str, str]) -> str:
    """Replace the value of each existing key, append the others as new `parameters` entries."""
    pending = dict(updates)

    def edit(m: re.Match) -> str:
        if m["key"] not in pending:
            return m.group(0)
        start, end = m.span("value")
        text = m.group(0)
        offset = m.start()
        return text[: start - offset] + _escape(pending.pop(m["key"])) + text[end - offset :]

    out = _PARAM_RE.sub(edit, pbtxt)
    for key, value in pending.items():
        out += f'\nparameters: {{\n  key: "{key}"\n  value: {{ string_value: "{_escape(value)}" }}\n}}\n'
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def apply_overrides(repo: Path, model: str, overrides: dict[str, str], dest: Path) -> Path:
    """A copy of `repo` under `dest` where `model`'s config.pbtxt carries the overrides. Everything else is a
    symlink (fragments are large), so relative paths in the model resolve to the original folder."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for entry in repo.iterdir():
        if entry.name != model:
            (dest / entry.name).symlink_to(entry.resolve())
    (dest / model).mkdir()
    for entry in (repo / model).iterdir():
        if entry.name != "config.pbtxt":
            (dest / model / entry.name).symlink_to(entry.resolve())
    text = (repo / model / "config.pbtxt").read_text()
    (dest / model / "config.pbtxt").write_text(set_parameters(text, overrides))
    return dest


def model_parameters(repo: Path, model: str, overrides: dict[str, str]) -> triton_params.ParsedParams:
    """Validate the file's parameters plus the overrides exactly as the model will at load."""
    raw = read_parameters((repo / model / "config.pbtxt").read_text())
    raw.update(overrides)
    return triton_params.parse_params(raw, base_dir=str(repo / model / "1"))
