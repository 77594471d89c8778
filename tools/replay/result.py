"""One replay's outcome: every request's record, the server's metrics over time, the unloaded probes and the
run's own health (send lag, missed scrapes, machine load), as JSON and as the raw files a report is built from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.replay.client import RequestRecord


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    samples: list[dict] = field(default_factory=list)  # the server's metrics over time
    unloaded_ttft_s: list[float] = field(default_factory=list)
    max_send_lag_s: float = 0.0  # how late the client sent anything: the open loop's own health
    metrics_errors: int = 0
    load_avg: tuple[float, float] | None = None  # the machine's 1-min load average at start and end

    def to_json(self) -> dict:
        return {
            "records": [asdict(r) for r in self.records],
            "samples": self.samples,
            "unloaded_ttft_s": self.unloaded_ttft_s,
            "max_send_lag_s": self.max_send_lag_s,
            "metrics_errors": self.metrics_errors,
            "load_avg": self.load_avg,
        }

    @classmethod
    def from_json(cls, data: dict) -> "ReplayResult":
        return cls(
            [RequestRecord(**r) for r in data["records"]],
            data["samples"],
            data["unloaded_ttft_s"],
            data.get("max_send_lag_s", 0.0),
            data.get("metrics_errors", 0),
            data.get("load_avg"),
        )


def save_raw(path: Path, policy: str, res: ReplayResult) -> None:
    """A policy's run as raw/<policy>.json, times rounded to 0.1 ms."""
    data = res.to_json()
    for r in data["records"]:  # milliseconds are plenty, and keep the files small
        for key in ("token_s", "chunk_s"):
            r[key] = [round(x, 4) for x in r[key]]
    data["policy"] = policy
    path.write_text(json.dumps(data))


def load_raw(path: Path) -> tuple[str, ReplayResult]:
    data = json.loads(path.read_text())
    return data["policy"], ReplayResult.from_json(data)
