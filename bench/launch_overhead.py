"""Launch overhead: launch -> first completed training step, keras_distrib local mode vs by hand.

    python bench/launch_overhead.py [--smoke] [--rounds 5] [--nodes 2]

A = `python -m keras_distrib.local --nodes N SCRIPT` (agent, servers, chief);
B = the same ps-per-node processes started directly with hand-written TF_CONFIG.
The ratio A/B is the launcher's cost; the target is <= 1.1.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _harness import Comparison, alternate, print_table, save
from _jobs import launcher_args, run_by_hand, run_keras_distrib


def main() -> None:
    args, rounds, nodes = launcher_args(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        c = Comparison("launch -> first step", "keras_distrib", "by hand", "s", target="<= 1.1")
        alternate(rounds, lambda: run_keras_distrib(work, nodes, "ps-per-node")[0], lambda: run_by_hand(work, nodes), c)
    print_table(f"Launch overhead, ps-per-node, {nodes} emulated node(s)", [c])
    save("launch_overhead", [c], {"nodes": nodes}, args.out)


if __name__ == "__main__":
    main()
