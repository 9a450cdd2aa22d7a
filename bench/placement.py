"""Placement: the parameter servers alone on a node of their own (a heterogeneous job)
against one ps beside every worker (ps-per-node), on the same three nodes.

    python bench/placement.py [--smoke] [--rounds 3] [--epochs 4]

Local mode: ``--nodes 3 --ps-nodes 1`` (two workers, the ps alone on the third node) against
``--nodes 3`` (three workers, three ps). An MLP on 24,000 synthetic rows (64 features, batch
64), exact epochs through ``keras_distrib.fit``; steps/s over the epochs after the first
(the optimizer's updates over their wall time). On one machine every "node" shares the same
cores and memory bus, so this shows what the plan itself costs or saves (one ps to talk to,
one worker fewer), not what a CPU node's own network and memory bring on a real cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _harness import Comparison, alternate, child_env, parser, print_table, save
from _jobs import free_port_base

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import keras_distrib
    strategy = keras_distrib.strategy()
    import keras

    epochs, rows = int(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype("float32")
    y = (x[:, :8].sum(axis=1) > 0).astype("int32")

    class Clock(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                self.start, self.updates = time.monotonic(), int(self.model.optimizer.iterations.numpy())

    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    clock = Clock()
    keras_distrib.fit(model, (x, y), epochs=epochs, batch_size=64, verbose=0, callbacks=[clock])
    steps = int(model.optimizer.iterations.numpy()) - clock.updates
    print("RESULT " + json.dumps({"steps_per_s": steps / (time.monotonic() - clock.start), "steps": steps}), flush=True)
    """
)


def run(workdir: Path, launcher: list[str], epochs: int, rows: int) -> float:
    """Steps/s of one local job started with ``launcher`` arguments."""
    script = workdir / "placement_job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", *launcher, "--port-base", str(free_port_base(12)),
         str(script), str(epochs), str(rows)],
        env=child_env(), cwd=workdir, capture_output=True, text=True, timeout=900,
    )
    results = [line.split("RESULT ", 1)[1] for line in proc.stdout.splitlines() if "RESULT " in line]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{' '.join(launcher)} failed with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return float(json.loads(results[-1])["steps_per_s"])


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    rounds, epochs, rows = (1, 2, 2_000) if args.smoke else (args.rounds, args.epochs, 24_000)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        comparison = alternate(
            rounds,
            lambda: run(workdir, ["--nodes", "3", "--ps-nodes", "1"], epochs, rows),
            lambda: run(workdir, ["--nodes", "3"], epochs, rows),
            Comparison("training steps/s, 3 nodes", "2 workers + ps node (--ps-nodes 1)",
                       "ps-per-node (3 workers, 3 ps)", "steps/s",
                       target="what the placement costs on one machine; not a cluster figure"),
        )
    print_table("Placement: parameter servers on a node of their own vs beside every worker", [comparison])
    save("placement", [comparison], {"epochs": epochs, "rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
