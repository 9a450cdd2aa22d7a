"""Launch overhead: launch -> first completed training step, keras_distrib local mode vs by hand.

    python bench/launch_overhead.py [--smoke] [--rounds 5] [--nodes 2]

A = `python -m keras_distrib.local --nodes N SCRIPT` (agent, servers, chief);
B = the same ps-per-node processes started directly with hand-written TF_CONFIG.
The ratio A/B is the launcher's cost; the target is <= 1.1.

A second row: the CPU seconds a TF server spends importing TensorFlow, the launcher's way
(`keras_distrib._private_apis.server_runtime`: the runtime modules a server uses, without
the public API and Keras) vs `import tensorflow` as is.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import Comparison, alternate, child_env, print_table, save
from _jobs import launcher_args, run_by_hand, run_keras_distrib


def import_cpu_seconds(launchers_way: bool) -> float:
    """User + system CPU seconds of a fresh process's TensorFlow import."""
    code = ("import keras_distrib.servers as s\ns.skip_optional_imports()\ns.server_runtime()\n" if launchers_way
            else "import tensorflow\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], env=child_env(), check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    args, rounds, nodes = launcher_args(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        c = Comparison("launch -> first step", "keras_distrib", "by hand", "s", target="<= 1.1")
        alternate(rounds, lambda: run_keras_distrib(work, nodes, "ps-per-node")[0], lambda: run_by_hand(work, nodes), c)
    imports = Comparison("server's TensorFlow import", "server_runtime", "import tensorflow", "CPU s", target="< 1")
    alternate(1 if args.smoke else max(rounds, 3), lambda: import_cpu_seconds(True), lambda: import_cpu_seconds(False),
              imports)
    print_table(f"Launch overhead, ps-per-node, {nodes} emulated node(s)", [c, imports])
    save("launch_overhead", [c, imports], {"nodes": nodes}, args.out)


if __name__ == "__main__":
    main()
