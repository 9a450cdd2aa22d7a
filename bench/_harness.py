"""Shared benchmark plumbing: alternate A/B runs, ratios with spread, a table, JSON and a PNG.

Every comparison is measured in one run: A and B alternate round by round, and each
round's ratio is reported as the median and the min-max spread over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


@dataclass
class Comparison:
    """A/B measurements of one quantity (higher_is_better tells how to read the ratio)."""

    name: str
    a_label: str
    b_label: str
    unit: str
    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)
    target: str = ""

    @property
    def ratios(self) -> list[float]:
        return [x / y for x, y in zip(self.a, self.b) if y]

    def summary(self) -> dict[str, float]:
        r = self.ratios
        return {
            "a_median": statistics.median(self.a),
            "b_median": statistics.median(self.b),
            "ratio_median": statistics.median(r),
            "ratio_min": min(r),
            "ratio_max": max(r),
            "rounds": len(r),
        }


def alternate(rounds: int, a: Callable[[], float], b: Callable[[], float], comparison: Comparison) -> Comparison:
    """Run A then B ``rounds`` times (B first on odd rounds, so drift hits both alike)."""
    for i in range(rounds):
        order = [(a, comparison.a), (b, comparison.b)]
        if i % 2:
            order.reverse()
        for fn, sink in order:
            sink.append(fn())
        print(f"  round {i + 1}/{rounds}: {comparison.a_label}={comparison.a[-1]:.4g} "
              f"{comparison.b_label}={comparison.b[-1]:.4g} {comparison.unit}", file=sys.stderr, flush=True)
    return comparison


def print_table(title: str, comparisons: Sequence[Comparison]) -> None:
    rows = [("comparison", "A", "B", "unit", "A median", "B median", "A/B median", "A/B min-max", "rounds", "target")]
    for c in comparisons:
        s = c.summary()
        rows.append((c.name, c.a_label, c.b_label, c.unit, f"{s['a_median']:.4g}", f"{s['b_median']:.4g}",
                     f"{s['ratio_median']:.3f}", f"{s['ratio_min']:.3f}-{s['ratio_max']:.3f}", str(s["rounds"]), c.target))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(title)
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def machine() -> dict[str, str]:
    import platform

    return {"cpus": str(os.cpu_count()), "platform": platform.platform(), "python": platform.python_version()}


def save(name: str, comparisons: Sequence[Comparison], extra: dict | None = None, out: Path = RESULTS) -> Path:
    """Write NAME.json and, when matplotlib is installed ([bench] extra), NAME.png."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "benchmark": name,
        "machine": machine(),
        "comparisons": [asdict(c) | {"summary": c.summary()} for c in comparisons],
        **(extra or {}),
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {path} (no plot: pip install -e '.[bench]' for matplotlib)")
        return path
    fig = comparison_grid(plt, comparisons)
    png = out / f"{name}.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    print(f"wrote {path} and {png}")
    return path


#: Panels per row of a benchmark's plot (more made one unreadable strip).
PLOT_COLUMNS = 3


def comparison_grid(plt: Any, comparisons: Sequence[Comparison]) -> Any:
    """One box plot per comparison (A and B over rounds), at most `PLOT_COLUMNS` a row."""
    import textwrap

    columns = min(PLOT_COLUMNS, len(comparisons))
    rows = -(-len(comparisons) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.0 * columns, 3.9 * rows), squeeze=False)
    for ax in axes.flat[len(comparisons):]:
        ax.set_visible(False)
    for ax, c in zip(axes.flat, comparisons):
        ax.boxplot([c.a, c.b], tick_labels=[textwrap.fill(c.a_label, 22), textwrap.fill(c.b_label, 22)])
        ax.set_title(textwrap.fill(c.name, 40) + f"\nA/B median {c.summary()['ratio_median']:.2f}", fontsize=10)
        ax.set_ylabel(c.unit, fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny configuration: proves the program works, measures nothing")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and PNG")
    return p


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repo importable and no scheduler variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "LSB_", "KERAS_DISTRIB_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra)
    return env
