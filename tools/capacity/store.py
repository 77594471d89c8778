"""One probe's raw result on disk, one JSON file per (traffic, pool, policy, seed, rate scale):

    <out>/raw/<traffic>/pool<tokens>/<policy>/seed<n>/x<rate>.json
    <out>/raw/<traffic>/pool<tokens>/<policy>/seed<n>/x<rate>.r<k>.json   (the k-th repeat of that probe)

holding every request's record and the server's metrics over time (tools.replay.result's raw format) plus a
`probe` block: the key, the verdict, the SLOs, when, on which commit, at what machine load. A plan run skips
a probe whose file exists (resumable); --force runs it again and overwrites it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.replay.result import ReplayResult, load_raw, save_raw
from tools.replay.servers import slug


@dataclass(slots=True, frozen=True, order=True)
class ProbeKey:
    traffic: str
    pool: int  # max_tokens_in_paged_kv_cache
    policy: str
    seed: int
    rate: float  # rate scale, 4 significant digits (search.round_rate)
    repeat: int = 0  # 0: the search's probe; k > 0: its k-th repeat (the within-seed noise, plan.repeat_nearest)

    def path(self, root: Path) -> Path:
        again = f".r{self.repeat}" if self.repeat else ""
        return (
            root
            / "raw"
            / self.traffic
            / f"pool{self.pool}"
            / slug(self.policy)
            / f"seed{self.seed}"
            / f"x{self.rate:g}{again}.json"
        )


def _replace_with(path: Path, data: dict) -> None:
    """Write beside, then rename: a killed run leaves no half file that a rerun would take as done."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def save(root: Path, key: ProbeKey, result: ReplayResult, probe: dict) -> Path:
    """Write atomically (_replace_with)."""
    path = key.path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_raw(tmp, key.policy, result)
    data = json.loads(tmp.read_text())
    data["probe"] = {**asdict(key), **probe}
    _replace_with(path, data)
    return path


def mark(path: Path, **fields) -> dict:
    """Add fields to a stored probe's block (atomically, as save does); returns the new block."""
    data = json.loads(path.read_text())
    data["probe"].update(fields)
    _replace_with(path, data)
    return data["probe"]


def load_probe(path: Path) -> dict:
    """The `probe` block alone (cheap enough for planning: the records are parsed but not kept)."""
    data = json.loads(path.read_text())
    if "probe" not in data:
        raise ValueError(f"{path}: not a capacity probe file (no 'probe' block)")
    return data["probe"]


def load_result(path: Path) -> tuple[dict, ReplayResult]:
    _, result = load_raw(path)
    return load_probe(path), result


_REPEAT = re.compile(r"\.r\d+$")


def stored(root: Path) -> list[Path]:
    """The searches' probes (one per rate): what capacities are computed from."""
    return [p for p in sorted((root / "raw").glob("*/pool*/*/seed*/x*.json")) if not _REPEAT.search(p.stem)]


def repeats(root: Path) -> list[Path]:
    """Repeats of probes already in stored(): evidence of the within-seed noise, never of a capacity."""
    return [p for p in sorted((root / "raw").glob("*/pool*/*/seed*/x*.json")) if _REPEAT.search(p.stem)]
