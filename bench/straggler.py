"""Stragglers: epoch time with one worker at half speed against undisturbed, parameter-server
layout, exact epochs (no ``steps_per_epoch``), and what the dynamic hand-out costs when no
worker is slow (issue 28).

    python bench/straggler.py [--smoke] [--rounds 3] [--workers 2,3] [--inputs arrays,tfdata]
                              [--layouts ps-per-node,worker-per-gpu] [--dynamic-only | --cost-only]

Local mode; ps-per-node with one node per worker, worker-per-gpu with one node of N emulated
GPUs (one ps, N workers: the same trainer, another placement); an MLP on 12,001 synthetic rows (64 features,
batch 32, K=10 steps per closure, 6 epochs). From the end of epoch 1 on, the last worker's
server is stopped 50 ms out of every 100 ms (SIGSTOP/SIGCONT), so it runs at about half
speed; the epoch time is the median over epochs 3-6 (`trainer.epoch_stats`).
* Inputs: in-memory arrays (``fit(model, (x, y), batch_size=32)``) and a ``tf.data`` of known
  size (``from_tensor_slices((x, y)).shuffle(n).batch(32)``). The smoke run: tf.data only.
* slowed / undisturbed, with the epoch handed out dynamically (`DynamicInput`,
  `DynamicDatasetInput`, the default for both) and with fixed per-worker shards
  (``trainer.dynamic_epochs = False``, what every other input gets). The dynamic ideal is N / (N - 1/2): x1.33 for 2 workers, x1.2
  for 3; fixed shards tend to x2.
* The slow worker's share of the epoch's steps (the per-epoch line's figures), dynamic.
* No slow worker: steps/s dynamic vs fixed shards (the cost of the hand-out).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from _harness import Comparison, child_env, parser, print_table, save
from _jobs import free_port_base
from recovery import task_pid

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import keras_distrib
    strategy = keras_distrib.strategy()
    import keras
    import tensorflow as tf

    marker, epochs, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    class Mark(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                open(marker, "w").close()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    from keras_distrib.trainers import trainer_for
    trainer = trainer_for(model)
    trainer.dynamic_epochs = os.environ["BENCH_DYNAMIC"] == "1"
    if os.environ["BENCH_INPUT"] == "tfdata":
        data, kw = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(rows, seed=1).batch(32),), {}
    else:
        data, kw = ((x, y),), {"batch_size": 32}
    keras_distrib.fit(model, *data, epochs=epochs, verbose=0, callbacks=[Mark()], **kw)
    if keras_distrib.cluster().is_chief:
        print("STATS", json.dumps(trainer.epoch_stats), flush=True)
    """
)


def duty_cycle(pid: int, stop: threading.Event, off: float = 0.05, period: float = 0.1) -> None:
    """Stop ``pid`` ``off`` seconds out of every ``period`` until ``stop`` is set."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(off)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period - off)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def layout_args(layout: str, workers: int) -> list[str]:
    """The local-mode options that give ``workers`` workers in ``layout``."""
    if layout == "worker-per-gpu":
        return ["--nodes", "1", "--layout", layout, "--gpus-per-node", ",".join(map(str, range(workers)))]
    return ["--nodes", str(workers), "--layout", layout]


def run(workdir: Path, workers: int, *, dynamic: bool, slowed: bool, epochs: int, rows: int,
        inputs: str = "arrays", layout: str = "ps-per-node") -> list[dict]:
    """One job; its epoch_stats (seconds, steps, worker_steps_per_sec per epoch)."""
    script = workdir / "straggler_job.py"
    script.write_text(SCRIPT)
    marker = workdir / f"epoch1-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_distrib.local", *layout_args(layout, workers),
         "--port-base", str(free_port_base(3 * workers + 2)), "--startup-timeout", "600", str(script),
         str(marker), str(epochs), str(rows)],
        cwd=workdir, env=child_env(BENCH_DYNAMIC="1" if dynamic else "0", BENCH_INPUT=inputs), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True)
    reader.start()
    stop = threading.Event()
    if slowed:
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = task_pid(proc.pid, f"worker:{workers - 1}")
        if pid is None:
            proc.kill()
            raise SystemExit(f"worker:{workers - 1} not found")
        threading.Thread(target=duty_cycle, args=(pid, stop), daemon=True).start()
    try:
        code = proc.wait(timeout=900)
    finally:
        stop.set()
    reader.join(timeout=5)
    stats = [json.loads(line.split("STATS ", 1)[1]) for line in lines if "STATS " in line]
    if code != 0 or not stats:
        tail = [line for line in lines if "keras_distrib" in line or "Error" in line][-30:]
        raise SystemExit(f"the job ({workers} workers, dynamic={dynamic}, slowed={slowed}) failed with {code}:\n"
                         + "\n".join(tail))
    return stats[-1]


def epoch_seconds(stats: list[dict]) -> float:
    return statistics.median(s["seconds"] for s in stats[2:])


def slow_share(stats: list[dict], workers: int) -> float:
    """The last worker's share of the steps of epochs 3.., against an even 1/N."""
    shares = []
    for s in stats[2:]:
        rates = {int(w): r for w, r in s["worker_steps_per_sec"].items()}
        shares.append(rates.get(workers - 1, 0.0) / max(sum(rates.values()), 1e-9))
    return statistics.median(shares)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--workers", default="2,3", help="worker counts to measure (default 2,3)")
    p.add_argument("--inputs", default="arrays,tfdata", help="input kinds to measure (default arrays,tfdata)")
    p.add_argument("--layouts", default="ps-per-node", help="layouts to measure (ps-per-node, worker-per-gpu)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--dynamic-only", action="store_true",
                      help="only the dynamic hand-out (no fixed-shard sides, no cost row): half the runs")
    only.add_argument("--cost-only", action="store_true",
                      help="only the cost row (no worker slowed, dynamic against fixed): half the runs")
    args = p.parse_args()
    fixed_too = not (args.smoke or args.dynamic_only)
    kinds = ["tfdata"] if args.smoke else args.inputs.split(",")
    layouts = args.layouts.split(",")
    rounds = 1 if args.smoke else args.rounds
    counts = [2] if args.smoke else [int(n) for n in args.workers.split(",")]
    epochs, rows = (4, 3001) if args.smoke else (6, 12001)
    comparisons, shares = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for layout, kind, n in [(layout, kind, n) for layout in layouts for kind in kinds for n in counts]:
            ideal = n / (n - 0.5)
            where = "" if layout == "ps-per-node" else f"{layout}, "
            sides = {dynamic: Comparison(
                f"{where}{kind}, {n} workers, one at half speed, {'dynamic hand-out' if dynamic else 'fixed shards'}: epoch s "
                f"(ideal x{ideal:.2f})", "slowed", "undisturbed", "s",
                target=f"<= {1.1 * ideal:.2f}" if dynamic else "reported") for dynamic in (True, False)}
            cost = Comparison(f"{where}{kind}, {n} workers, none slow: dynamic hand-out vs fixed shards", "dynamic",
                              "fixed", "steps/s", target=">= 0.97")
            key = ("" if layout == "ps-per-node" else f"{layout}-") + (f"{n}" if kind == "arrays" else f"{kind}-{n}")
            shares[key] = []
            for i in range(rounds):
                for dynamic in ((True, False) if fixed_too else (True,)):
                    slowed = None if args.cost_only else run(work, n, dynamic=dynamic, slowed=True, epochs=epochs,
                                                             rows=rows, inputs=kind, layout=layout)
                    calm = run(work, n, dynamic=dynamic, slowed=False, epochs=epochs, rows=rows, inputs=kind,
                               layout=layout)
                    cost_side = cost.a if dynamic else cost.b
                    cost_side.append(statistics.median(s["steps_per_sec"] for s in calm[2:]))
                    if slowed is None:
                        print(f"  {where}{kind}, {n} workers round {i + 1}/{rounds} dynamic={dynamic}: "
                              f"{cost_side[-1]:.1f} steps/s", file=sys.stderr, flush=True)
                        continue
                    sides[dynamic].a.append(epoch_seconds(slowed))
                    sides[dynamic].b.append(epoch_seconds(calm))
                    if dynamic:
                        shares[key].append(slow_share(slowed, n))
                    print(f"  {where}{kind}, {n} workers round {i + 1}/{rounds} dynamic={dynamic}: slowed "
                          f"{sides[dynamic].a[-1]:.2f} s, undisturbed {sides[dynamic].b[-1]:.2f} s",
                          file=sys.stderr, flush=True)
            if not args.cost_only:
                comparisons.append(sides[True])
            if fixed_too:
                comparisons += ([] if args.cost_only else [sides[False]]) + [cost]
    print_table("Stragglers (parameter-server layout, exact epochs)", comparisons)
    for n, values in shares.items():
        if not values:
            continue
        workers = int(n.rsplit("-", 1)[-1])
        print(f"{n} workers: the slow worker ran {statistics.median(values):.2f} of the steps (even: {1 / workers:.2f})")
    save("straggler", comparisons, {"slow_worker_share": shares}, out=args.out)


if __name__ == "__main__":
    main()
