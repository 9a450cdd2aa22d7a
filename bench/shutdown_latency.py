"""Shutdown latency: the script's exit -> the last process of the job gone, per layout.

    python bench/shutdown_latency.py [--smoke] [--rounds 5] [--nodes 2]

Measured in local mode; each layout is compared with ps-per-node in the same rounds.
(Without a launcher, TensorFlow's ps and worker servers never exit at all.)
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from _harness import Comparison, print_table, save
from _jobs import launcher_args, run_keras_distrib

LAYOUTS = ("ps-per-node", "worker-per-gpu", "allreduce")


def main() -> None:
    args, rounds, nodes = launcher_args(__doc__)
    latency: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for layout in LAYOUTS:
                latency[layout].append(run_keras_distrib(Path(tmp), nodes, layout)[1])
            print(f"  round {i + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in latency.items()), flush=True)
    comparisons = [
        Comparison(f"shutdown {layout} vs ps-per-node", layout, "ps-per-node", "s", latency[layout], latency["ps-per-node"])
        for layout in LAYOUTS[1:]
    ]
    print(f"Shutdown latency, {nodes} emulated node(s): script exit -> last process gone")
    for layout in LAYOUTS:
        v = latency[layout]
        print(f"  {layout:<15} median {statistics.median(v):.3f} s  (min {min(v):.3f}, max {max(v):.3f}, {len(v)} runs)")
    print_table("Relative to ps-per-node", comparisons)
    save("shutdown_latency", comparisons, {"nodes": nodes, "seconds": latency}, args.out)


if __name__ == "__main__":
    main()
