"""The run's time budget, its sections and the one JSON that holds them, rewritten after every section.

A section either passes its checks ("passed"), fails one ("failed"), only measures ("measured"), raises ("error":
the message and traceback are kept and the next section runs), or is skipped: when the time left is below what it
needs, or when a section it needs did not succeed. A lease that ends mid-run still leaves the JSON of every section
finished before.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

RESULT_FILE = "gpu_check.json"


class Run:
    def __init__(self, out_dir: Path, budget_s: float, meta: dict):
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.path = Path(out_dir) / RESULT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = {**meta, "budget_s": budget_s, "sections": {}, "ok": None}
        self.write()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def deadline(self, reserve_s: float = 0.0) -> float:
        """time.monotonic() by which a section's loop stops, keeping `reserve_s` for the sections after it."""
        return self.t0 + self.budget_s - reserve_s

    def log(self, text: str) -> None:
        print(f"[gpu_check +{self.elapsed():6.1f}s] {text}", flush=True)

    def section(
        self, name: str, fn, need_s: float, needs: tuple[str, ...] = (), not_after: tuple[str, ...] = ()
    ) -> dict:
        """Run `fn()` (a dict, with "ok": bool where the section checks something) as section `name` unless fewer
        than `need_s` seconds are left, a section in `needs` did not succeed, or one in `not_after` raised; returns
        what was recorded."""
        raised = [n for n in not_after if self.status(n) == "error"]
        if raised:
            return self._record(name, {"status": "skipped", "reason": f"{', '.join(raised)} raised"})
        missing = [n for n in needs if self.status(n) not in ("passed", "measured")]
        if missing:
            return self._record(name, {"status": "skipped", "reason": f"needs {', '.join(missing)}"})
        if self.left() < need_s:
            return self._record(
                name,
                {"status": "skipped", "reason": f"budget: {self.left():.0f} s left, it needs about {need_s:.0f} s"},
            )
        self.log(f"{name} ...")
        t = time.monotonic()
        try:
            result = fn()
        except Exception as e:  # NOTE: one lease, every section: a failure is recorded and the run goes on
            result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        else:
            result = {"status": {True: "passed", False: "failed", None: "measured"}[result.get("ok")], **result}
        result["seconds"] = round(time.monotonic() - t, 2)
        return self._record(name, result)

    def _record(self, name: str, result: dict) -> dict:
        self.data["sections"][name] = result
        extra = result.get("error") or result.get("reason") or ""
        self.log(
            f"{name}: {result['status']}"
            + (f" ({extra})" if extra else "")
            + (f" in {result['seconds']} s" if "seconds" in result else "")
        )
        self.write()
        return result

    def status(self, name: str) -> str | None:
        return self.data["sections"].get(name, {}).get("status")

    def finish(self) -> bool:
        """Overall: no section failed or raised (skipped ones are listed, not failures)."""
        statuses = {n: s["status"] for n, s in self.data["sections"].items()}
        self.data["ok"] = not any(s in ("failed", "error") for s in statuses.values())
        self.data["skipped"] = [n for n, s in statuses.items() if s == "skipped"]
        self.data["wall_s"] = round(self.elapsed(), 1)
        self.write()
        return self.data["ok"]

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
