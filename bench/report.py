"""Print the performance table of docs/performance.md from bench/results/*.json.

    python bench/report.py [--out DIR]

Run the benchmarks first (each writes its JSON); this only formats what they measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _harness import RESULTS

ORDER = ("ps_throughput", "ps_step_breakdown", "sync_throughput", "input_stall", "launch_overhead", "shutdown_latency", "plan_scaling",
         "straggler", "placement")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    print("| benchmark | comparison (A vs B) | A/B median | min-max | rounds | target |")
    print("|---|---|---|---|---|---|")
    machine = None
    for name in ORDER:
        path = args.out / f"{name}.json"
        if not path.exists():
            print(f"| {name} | not run | | | | |")
            continue
        data = json.loads(path.read_text())
        machine = machine or data.get("machine")
        for c in data["comparisons"]:
            s = c["summary"]
            print(f"| `{name}` | {c['name']}: {c['a_label']} vs {c['b_label']} ({c['unit']}) | "
                  f"{s['ratio_median']:.3f} | {s['ratio_min']:.3f}-{s['ratio_max']:.3f} | {s['rounds']} | {c['target']} |")
    if machine:
        print(f"\nMachine: {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']}.")


if __name__ == "__main__":
    main()
