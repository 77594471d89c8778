"""Render the Grafana dashboard's panels from Prometheus data into one PNG (matplotlib).

Why: Grafana itself cannot be installed here (no image registry; no Debian, PyPI or npm package ships
the server), so this draws the *same* panels -- titles, layout, PromQL and legends read from
docker/grafana/dashboards/morphserve.json -- from a Prometheus that scraped the server.

    python docker/render_panels.py --prometheus http://127.0.0.1:9090 --out results/docker/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

from datetime import datetime

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = Path(__file__).parent / "grafana" / "dashboards" / "morphserve.json"
ROW_PX = 0.32  # inches per Grafana grid row (30 px at ~94 dpi)
UNITS = {"percentunit": (100, "%"), "bytes": (1 / 2**20, " MiB"), "s": (1000, " ms"), "reqps": (1, " req/s")}


def stat_text(v: float, unit: str) -> str:
    """Grafana-like stat value: whole numbers as such, bytes in binary units, ratios in percent."""
    if unit == "bytes":
        for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= div:
                return f"{v / div:.2f} {name}"
        return f"{v:.0f} B"
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:.3g}"


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    # Grafana's $__rate_interval has no meaning to Prometheus: use a fixed window of several scrapes.
    expr = expr.replace("$__rate_interval", "1m")
    qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{qs}", timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels or "value")


def draw(ax, panel: dict, series: list[tuple[str, list, list]]) -> None:
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    scale, suffix = UNITS.get(unit, (1, ""))
    ax.set_title(panel["title"], loc="left", fontsize=9, color="#d8d9da")
    ax.set_facecolor("#181b1f")
    ax.tick_params(colors="#9fa1a6", labelsize=7)
    for s in ax.spines.values():
        s.set_color("#2c3235")
    if panel["type"] == "stat":
        last = [ys[-1] for _, _, ys in series if ys]
        text = stat_text(last[0], unit) if last else "No data"
        ax.text(0.5, 0.4, text, ha="center", va="center", fontsize=20, color="#73bf69", transform=ax.transAxes)
        ax.set_xticks([]), ax.set_yticks([])
        return
    for name, xs, ys in series:
        ax.plot([datetime.fromtimestamp(x) for x in xs], [y * scale for y in ys], lw=1.5, label=name)
    if not series:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", color="#9fa1a6", transform=ax.transAxes)
    ax.grid(color="#2c3235", lw=0.5)
    lim = panel["fieldConfig"]["defaults"]
    if "min" in lim or "max" in lim:
        ax.set_ylim(lim.get("min", 0) * scale, lim.get("max", 1) * scale)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    if suffix:
        ax.set_ylabel(suffix.strip(), fontsize=7, color="#9fa1a6")
    if series:
        ax.legend(fontsize=7, loc="upper left", facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235")


def render(prom: str, out: Path, minutes: float, dashboard: Path = DASHBOARD) -> int:
    dash = json.loads(dashboard.read_text())
    end = time.time()
    start, step = end - minutes * 60, max(1.0, minutes * 60 / 240)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    fig = plt.figure(figsize=(16, rows * ROW_PX + 0.6), facecolor="#111217")
    fig.suptitle(
        f"{dash['title']} -- panels of the Grafana dashboard, rendered from Prometheus data",
        color="#d8d9da",
        fontsize=11,
        x=0.01,
        ha="left",
    )
    top = 1 - 0.6 / (rows * ROW_PX + 0.6)
    with_data = 0
    for p in dash["panels"]:
        g = p["gridPos"]
        # Leave room inside each grid cell for tick labels (Grafana draws them inside the panel too).
        pad = 0.0 if p["type"] == "stat" else 0.035
        rect = [
            g["x"] / 24 + 0.006 + pad,
            top - (g["y"] + g["h"]) / rows * top + 0.02,
            g["w"] / 24 - 0.014 - pad,
            g["h"] / rows * top - 0.035,
        ]
        series = []
        for t in p["targets"]:
            for r in query_range(prom, t["expr"], start, end, step):
                xs = [float(v[0]) for v in r["values"]]
                ys = [float(v[1]) for v in r["values"]]
                series.append((legend(t.get("legendFormat", ""), r["metric"]), xs, ys))
        with_data += bool(series)
        draw(fig.add_axes(rect), p, series)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, facecolor=fig.get_facecolor())
    return with_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--out", type=Path, default=Path("results/docker/dashboard.png"))
    ap.add_argument("--minutes", type=float, default=5.0, help="time range shown, ending now")
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    a = ap.parse_args()
    n = render(a.prometheus, a.out, a.minutes, a.dashboard)
    print(f"[render] {a.out}: {n} panels with data")


if __name__ == "__main__":
    main()
