"""The fragment set on disk: manifest.json, its model config, and verified file access."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import FragmentError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HEAD_UNIT = "lm_head"  # the tied embedding / LM head: its manifest key and its name in the swap order


@dataclass(slots=True, frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of one token for all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path, **extra) -> dict:
    """The manifest entry of a freshly written fragment file. Also makes it world-readable: safetensors
    writes 0600, and a serving user other than the builder (a container's) must read the set."""
    path.chmod(0o644)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path), **extra}


class Manifest:
    """Read-side view of a fragment directory. Every file access checks size and sha256."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise FragmentError(f"{path}: manifest not found (build it with `python -m engines.build_fragments`)")
        try:
            self.data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise FragmentError(f"{path}: not valid JSON ({e})") from None
        if self.data.get("format_version") != FORMAT_VERSION:
            raise FragmentError(
                f"{path}: format_version {self.data.get('format_version')!r}, expected {FORMAT_VERSION}"
            )
        self.config = ModelConfig(**self.data["config"])

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def precisions(self, layer: int) -> list[str]:
        return list(self.data["layers"][layer]["fragments"])

    def fragment(self, layer: int, precision: str) -> dict:
        frags = self.data["layers"][layer]["fragments"]
        if precision not in frags:
            raise FragmentError(f"layer {layer}: no '{precision}' fragment in {self.dir / MANIFEST}")
        return frags[precision]

    def swap_order(self) -> list[int]:
        """Layers in the order they are swapped down; front-to-back when no profile exists."""
        order = self.data.get("swap_order")
        return list(order) if order else list(range(self.num_layers))

    # ---- the tied embedding / LM head as a unit (data["lm_head"], optional; engines.build_fragments) ----------
    def head_precisions(self) -> list[str]:
        """The forms of the tied embedding / LM head table: "full" (in the shared file) and any fragments."""
        return ["full", *self.data.get(HEAD_UNIT, {}).get("fragments", {})]

    def head_fragment(self, precision: str) -> dict:
        frags = self.data.get(HEAD_UNIT, {}).get("fragments", {})
        if precision not in frags:
            raise FragmentError(f"lm_head: no '{precision}' fragment in {self.dir / MANIFEST}")
        return frags[precision]

    def head_swappable(self) -> bool:
        """The table is tied and has an INT8 fragment: it is one unit of the swap order."""
        return self.config.tie_word_embeddings and "int8" in self.head_precisions()

    def unit_order(self) -> list[int | str]:
        """The swap order of every swappable unit: the layers' order with HEAD_UNIT at its rank (the position the
        importance score gave it, engines.layer_importance.head_rank; first when not profiled)."""
        order: list[int | str] = self.swap_order()
        if self.head_swappable():
            rank = self.data[HEAD_UNIT].get("swap_rank") or 0
            order.insert(min(max(0, int(rank)), len(order)), HEAD_UNIT)
        return order

    def side_file(self, name: str) -> Path:
        """A plain side file (the tokenizer); it is generated with the set but carries no hash."""
        path = self.dir / name
        if not path.is_file():
            raise FragmentError(f"{path}: file missing")
        return path

    def verified_path(self, entry: dict) -> Path:
        path = self.dir / entry["file"]
        if not path.is_file():
            raise FragmentError(f"{path}: fragment file missing")
        if path.stat().st_size != entry["bytes"]:
            raise FragmentError(f"{path}: size {path.stat().st_size} != manifest {entry['bytes']}")
        if sha256_file(path) != entry["sha256"]:
            raise FragmentError(f"{path}: sha256 mismatch (corrupt or modified fragment)")
        return path


def write_manifest(directory: Path, data: dict) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(directory / MANIFEST)  # atomic: readers never see half a manifest


def config_dict(config: ModelConfig) -> dict:
    return asdict(config)
