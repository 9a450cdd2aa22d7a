"""Recovery: from a SIGKILL to training progressing again, per kind of death; and the cost
of periodic checkpoints as a steps/s ratio.

    python bench/recovery.py [--smoke] [--rounds 3]

Local mode, 2 emulated nodes (--nodes), an MLP on synthetic data (batch 32, K=10 steps per closure).
* Recovery time: the training script appends "pid time" to a file at every completed
  closure (a batch callback). After the kill, recovery is the first completed closure of
  the restarted SCRIPT (ps, chief, all-reduce worker: they resume from the checkpoint), or,
  for a worker in the ps layouts (training never stops), the restarted server's first
  "serving" line. Compared with the time the same job took from launch to its first closure.
* Checkpoint cost: steps/s of the whole training run with mid-epoch checkpoints every
  `--interval` seconds vs epoch-end checkpoints only. The default interval (120 s) would
  fire once in a short run, so the cost per checkpoint is measured at a short interval and
  the ratio implied at the default is printed too: 1 - (seconds per checkpoint / 120).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Sequence

from _harness import Comparison, child_env, parser, print_table, save
from _jobs import free_port_base

DEFAULT_INTERVAL_SECONDS = 120.0
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import keras_distrib
    strategy = keras_distrib.strategy()
    import keras

    progress, directory, epochs, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with open(progress, "a") as fh:
                fh.write(f"{os.getpid()} {time.time()}\\n")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 32)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    started = time.time()
    keras_distrib.fit(model, (x, y), epochs=epochs, steps_per_epoch=steps, batch_size=32, verbose=0,
                      checkpoint_dir=directory, callbacks=[Progress()])
    if keras_distrib.cluster().is_chief:
        print("RATE", epochs * steps / (time.time() - started), flush=True)
    """
)
KINDS = {  # kind -> (layout, task killed)
    "worker (ps layout)": ("ps-per-node", "worker:1"),
    "ps": ("ps-per-node", "ps:1"),
    "chief": ("ps-per-node", "chief:0"),
    "allreduce worker": ("allreduce", "worker:1"),
}


def progress_lines(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def task_pid(launcher: int, task: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == launcher and f"KERAS_DISTRIB_TASK={task}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def launch(workdir: Path, layout: str, interval: str, epochs: int, steps: int,
           extra: Sequence[str] = (), *, nodes: int = 2) -> tuple[subprocess.Popen[str], Path, list[tuple[float, str]]]:
    """The training job of SCRIPT (launcher options ``extra`` added); its output lines are
    collected with their arrival time. Returns (launcher, progress file, lines)."""
    script = workdir / "train.py"
    script.write_text(SCRIPT)
    progress = workdir / f"progress-{time.monotonic_ns()}"
    ckpt = workdir / f"ckpt-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", str(nodes), "--layout", layout, "--port-base",
         str(free_port_base(3 * nodes + 2)), "--checkpoint-every", interval, "--startup-timeout", "600", *extra, str(script),
         str(progress), str(ckpt), str(epochs), str(steps)],
        cwd=workdir, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    threading.Thread(target=read, daemon=True).start()
    return proc, progress, lines


def finish(proc: subprocess.Popen[str], lines: list[tuple[float, str]], what: str) -> None:
    if proc.wait(timeout=900) != 0:
        tail = [text for _, text in lines if "keras_distrib" in text or "Error" in text][-30:]
        raise SystemExit(f"{what} failed with exit code {proc.returncode}:\n" + "\n".join(tail))
    time.sleep(0.2)  # the reader thread drains the last lines


def recovery(workdir: Path, kind: str, epochs: int, steps: int, nodes: int) -> tuple[float, float]:
    """(seconds from the kill to progress again, seconds from launch to the first closure)."""
    layout, task = KINDS[kind]
    started = time.time()
    proc, progress, lines = launch(workdir, layout, "1s", epochs, steps, nodes=nodes)
    deadline = time.monotonic() + 600
    while len(progress_lines(progress)) < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    first = progress_lines(progress)[0][1] - started
    pid = task_pid(proc.pid, task)
    if pid is None:
        proc.kill()
        raise SystemExit(f"{task} not found")
    killed = time.time()
    subprocess.run(["kill", "-9", str(pid)], check=True)
    finish(proc, lines, kind)
    if task.startswith("worker") and layout != "allreduce":
        serving = [t for t, text in lines if f"serving {task}" in text and t > killed]
        if not serving:
            raise SystemExit(f"training ended before the restarted {task} served: raise the steps")
        return serving[0] - killed, first
    old = {p for p, t in progress_lines(progress) if t < killed}
    after = [t for p, t in progress_lines(progress) if t > killed and p not in old]
    if not after:
        raise SystemExit(f"no progress after killing {task}")
    return after[0] - killed, first


def rate(workdir: Path, interval: str, epochs: int, steps: int, nodes: int) -> float:
    """Steps/s of the whole training run with checkpoints every ``interval``."""
    proc, _, lines = launch(workdir, "ps-per-node", interval, epochs, steps, nodes=nodes)
    finish(proc, lines, f"training with --checkpoint-every {interval}")
    rates = [float(text.rsplit(" ", 1)[1]) for _, text in lines if "] RATE " in text]
    return rates[-1]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--interval", default="2s", help="short checkpoint interval measured (default 2s)")
    p.add_argument("--nodes", type=int, default=None,
                   help="emulated nodes (default 2; --smoke: 1, which only the chief's recovery needs)")
    args = p.parse_args()
    rounds = 1 if args.smoke else args.rounds
    epochs, steps = (2, 80) if args.smoke else (3, 1000)
    kinds = ["chief"] if args.smoke else list(KINDS)
    nodes = args.nodes or (1 if args.smoke else 2)
    if nodes < 2 and kinds != ["chief"]:
        p.error(f"--nodes {nodes}: killing worker:1 and ps:1 needs 2 nodes. HINT: --nodes 2")
    comparisons = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kind in kinds:
            c = Comparison(f"recovery: {kind}", "kill -> progress", "launch -> 1st closure", "s")
            for i in range(rounds):
                back, first = recovery(work, kind, epochs, steps, nodes)
                c.a.append(back)
                c.b.append(first)
                print(f"  {kind} round {i + 1}/{rounds}: back in {back:.2f} s (launch -> first closure {first:.2f} s)", flush=True)
            comparisons.append(c)
        cost = Comparison(f"steps/s, checkpoints every {args.interval} vs epoch ends", args.interval, "epoch",
                          "steps/s", target="> 0.95 at the default 120s")
        for i in range(rounds):
            for interval, sink in ((args.interval, cost.a), ("epoch", cost.b)) if i % 2 == 0 else (("epoch", cost.b), (args.interval, cost.a)):
                sink.append(rate(work, interval, epochs, steps, nodes))
            print(f"  checkpoint cost round {i + 1}/{rounds}: {cost.a[-1]:.1f} vs {cost.b[-1]:.1f} steps/s", flush=True)
        comparisons.append(cost)
    seconds = float(args.interval.rstrip("s"))
    ratio = statistics.median(cost.ratios)
    # Steps/s ratio r at interval T means each T seconds of training cost T/r: one checkpoint
    # costs T*(1/r - 1) seconds; at the default interval D the ratio is D / (D + that).
    per_checkpoint = max(0.0, seconds * (1 / ratio - 1))
    implied = DEFAULT_INTERVAL_SECONDS / (DEFAULT_INTERVAL_SECONDS + per_checkpoint)
    print_table(f"Recovery and checkpoint cost (local mode, {nodes} emulated node(s))", comparisons)
    print(f"one checkpoint costs about {per_checkpoint:.3f} s of training; implied steps/s ratio at the "
          f"default {DEFAULT_INTERVAL_SECONDS:.0f} s interval: {implied:.4f} (goal > 0.95)")
    save("recovery", comparisons, {"seconds_per_checkpoint": per_checkpoint, "implied_ratio_at_default": implied}, args.out)


if __name__ == "__main__":
    main()
