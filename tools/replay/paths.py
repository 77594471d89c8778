"""Paths of the replay harness: given relative to the repository root (defaults point at ../shared), and
printed relative to it so that no report carries a machine's path."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_path(path: str | Path) -> Path:
    """Relative paths are relative to the repository root."""
    path = Path(path)
    return path if path.is_absolute() else (REPO_ROOT / path).resolve()


def shown(path: Path) -> str:
    """A path relative to the repository when it is inside it."""
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
