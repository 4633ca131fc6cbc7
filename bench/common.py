"""Helpers every benchmark shares: percentiles, the markdown report, the PNG plot and the
JSON summary that ends each run's stdout (so a script or CI can read the figures with
`tail -n 1`)."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks like numpy's default;
    NaN for no values so an empty sample shows up instead of passing as 0."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def ratio(num: float, den: float) -> float:
    return num / den if den and math.isfinite(den) else math.nan


def machine() -> dict[str, Any]:
    """What the figures depend on: they are only comparable on the same machine."""
    return {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def log(msg: str) -> None:
    """A progress line; flushed so it shows while a long phase runs."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(path: Path, title: str, table: str, setup: Mapping[str, Any],
                 notes: Sequence[str] = ()) -> None:
    """A markdown report: the table first, then the setup it was measured on."""
    parts = [f"# {title}", "", table, "", "## Setup", ""]
    parts += [f"- {key}: {value}" for key, value in setup.items()]
    if notes:
        parts += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def plot_distributions(path: Path, series: Mapping[str, Sequence[float]], title: str,
                       xlabel: str, histogram: bool = True,
                       styles: Mapping[str, Mapping[str, Any]] | None = None,
                       log_x: bool = False) -> None:
    """Empirical CDFs of one measure for several systems, beside overlaid histograms unless
    `histogram` is False (series of very different sizes make histograms unreadable).
    `styles`: matplotlib line keywords per series name. `log_x`: the CDF's axis in
    decades, for series hundreds of times apart."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; set before pyplot is imported
    import matplotlib.pyplot as plt

    if histogram:
        fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4.2))
        _histograms(hist, series, xlabel)
    else:
        fig, cdf = plt.subplots(figsize=(7.5, 4.5))
    for name, values in series.items():
        if values:
            ordered = sorted(values)
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            cdf.step(ordered, ys, where="post", label=name, **(styles or {}).get(name, {}))
    cdf.set(xlabel=xlabel, ylabel="fraction of requests", title="CDF", ylim=(0, 1.02))
    if log_x:
        cdf.set_xscale("log")
    cdf.grid(alpha=0.3)
    cdf.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _histograms(ax: Any, series: Mapping[str, Sequence[float]], xlabel: str) -> None:
    pooled = [v for values in series.values() for v in values]
    # One set of bin edges for every system, so bar heights compare directly.
    low, high = (min(pooled), max(pooled)) if pooled else (0.0, 1.0)
    edges = [low + (high - low) * i / 40 for i in range(41)] if high > low else 40
    for name, values in series.items():
        if values:
            ax.hist(values, bins=edges, alpha=0.55, label=name)
    ax.set(xlabel=xlabel, ylabel="requests", title="histogram")
    ax.grid(alpha=0.3)
    ax.legend()


def _finite(value: Any) -> Any:
    """JSON has no NaN: missing figures become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, figures: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(dict(figures)), indent=2) + "\n")


def print_json_last(figures: Mapping[str, Any]) -> None:
    """The run's figures as one JSON object on one line; call it last."""
    sys.stdout.flush()
    print(json.dumps(_finite(dict(figures)), separators=(",", ":")), flush=True)
