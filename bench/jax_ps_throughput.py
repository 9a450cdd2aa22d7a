"""Parameter servers on JAX: the asynchronous trainer's steps/s and accuracy.

    python bench/jax_ps_throughput.py [--smoke] [--rounds 3] [--models mlp,cnn] [--batch 64]
                                      [--epochs 3] [--accuracy] [--seeds 3]

Local mode, ``--nodes 2 --layout ps-per-node``: 2 ps, 2 workers and the chief. Per model
(bench/_train_jobs.py), each round launches every side afresh, in a rotated order:
A = the job SCRIPT under ``KERAS_BACKEND=jax`` (`keras_distrib.fit`, the JAX ps trainer),
B = the same SCRIPT and command under ``KERAS_BACKEND=tensorflow`` (the TensorFlow ps trainer),
C = one JAX process, plain Keras ``model.fit`` (compiled as is: steps_per_execution=1), with the
    XLA flag the launcher gives its JAX processes (`keras_distrib.contract.XLA_CPU_FLAG`),
D = the same in one TensorFlow process.
Every side trains ``--epochs`` exact epochs of the same synthetic arrays (`EXAMPLES` rows,
``--batch`` examples per optimizer update); steps/s = the median over epochs 2.. of the chief's
``epoch_stats`` (A, B) or of an epoch-timing callback (C, D). A/B is the goal (>= 1.0); A/C is
what distribution costs on this machine (reported); C/D is how fast the two backends' own kernels
run the model on this machine, a bound A/B cannot beat by much (reported).

Accuracy (always, except in a ``--smoke`` run without ``--accuracy``): the digits data
(scikit-learn; the CNN gets each 8x8 image scaled 3x and padded to 28x28), the same split as
bench/accuracy_parity.py; per seed, the JAX ps job and one JAX process train the same model
from the same initial weights for `ACCURACY_EPOCHS` epochs, and the test accuracies are
compared (one job per side and model trains every seed). Target: within 1 point.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import Comparison, child_env, parser, print_table, save  # noqa: E402
from _jobs import free_port_base  # noqa: E402

from keras_distrib.contract import XLA_CPU_FLAG  # noqa: E402

#: Training rows per model, at batch 64 on 2 cores: the MLP 600 steps an epoch (3.1-3.5 s on
#: either ps trainer); the CNN 150 (2.6-3.2 s on the ps trainers, 2 s in one process), so a run of
#: both models, 3 rounds and the accuracy seeds takes about 14 minutes.
EXAMPLES = {"mlp": 38_400, "cnn": 9_600}
DEFAULT_EXAMPLES = 9_600
ACCURACY_EPOCHS = 15
RESULT_PREFIX = "JAX_PS_BENCH "
SIDES = ("jax_ps", "tf_ps", "single", "single_tf")
TIMEOUT = 1200.0

# Runs as the chief and (JAX) every worker of the job, or alone (side "single"). The chief, or
# the single process, prints one RESULT_PREFIX line: per seed, the epoch stats and the test accuracy.
SCRIPT = textwrap.dedent(
    """
    import json, math, os, sys
    side, task, model_spec = sys.argv[1], sys.argv[2], sys.argv[3]
    examples, epochs, batch = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    seeds = [int(s) for s in sys.argv[7].split(",")]
    sys.path.insert(0, os.environ["BENCH_DIR"])
    import keras_distrib
    import keras_distrib.trainers
    distributed = not side.startswith("single")
    strategy = keras_distrib.strategy() if distributed else None
    import keras
    import numpy as np
    from _train_jobs import compile_model, epoch_timer, load_model_fn, synthetic

    model_fn = load_model_fn(model_spec)
    reports = keras_distrib.cluster().is_chief if distributed else True


    def digits():
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        x = (d.data / 16.0).astype("float32")
        shape = tuple(model_fn(keras).input_shape[1:])
        if shape == (28, 28, 1):
            x = np.pad(np.kron(x.reshape(-1, 8, 8), np.ones((3, 3), "float32")), ((0, 0), (2, 2), (2, 2)))[..., None]
        elif shape != (64,):
            raise SystemExit(f"accuracy: digits fit inputs of shape (64,) or (28, 28, 1), not {shape}")
        return train_test_split(x, d.target.astype("int32"), test_size=0.2, random_state=0)


    def train(x, y, seed):
        keras.utils.set_random_seed(seed)
        make = lambda: compile_model(model_fn(keras), keras)
        if distributed:
            model = keras_distrib.trainers.build(make, strategy)
            keras_distrib.fit(model, (x, y), epochs=epochs, batch_size=batch, verbose=0, seed=seed)
            stats = keras_distrib.trainers.trainer_for(model).epoch_stats if reports else []
        else:
            model, timer = make(), epoch_timer(keras.callbacks.Callback)
            model.fit(x, y, epochs=epochs, batch_size=batch, verbose=0, callbacks=[timer])
            steps = math.ceil(len(x) / batch)
            stats = [{"epoch": i, "seconds": s, "steps": steps, "steps_per_sec": steps / s}
                     for i, s in enumerate(timer.seconds)]
        keep = [{"epoch": int(s["epoch"]), "seconds": float(s["seconds"]), "steps": int(s["steps"]),
                 "steps_per_sec": float(s["steps_per_sec"])} for s in stats]
        return model, keep


    if task == "accuracy":
        x, x_test, y, y_test = digits()
    else:
        x, y = synthetic(model_fn, examples)
    runs = []
    for seed in seeds:
        model, stats = train(x, y, seed)
        run = {"seed": seed, "stats": stats}
        if task == "accuracy" and reports:
            evaluate = keras_distrib.evaluate if distributed else lambda m, d, **kw: m.evaluate(*d, **kw)
            run["accuracy"] = float(evaluate(model, (x_test, y_test), batch_size=batch, verbose=0,
                                             return_dict=True)["accuracy"])
        runs.append(run)
    if reports:
        print("%s%s" % (os.environ["BENCH_PREFIX"], json.dumps(runs)), flush=True)
    """
)


def command(workdir: Path, side: str) -> tuple[list[str], dict[str, str]]:
    """The argv (without the SCRIPT's own arguments) and environment of one side."""
    script = workdir / "jax_ps_job.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = child_env(KERAS_BACKEND="tensorflow" if side in ("tf_ps", "single_tf") else "jax", JAX_PLATFORMS="cpu",
                    CUDA_VISIBLE_DEVICES="", BENCH_DIR=str(HERE), BENCH_PREFIX=RESULT_PREFIX)
    if side == "single":  # the kernels the launcher's JAX processes run (the ps side gets it from the launcher)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_CPU_FLAG}".strip()
    if side.startswith("single"):
        return [sys.executable, str(script)], env
    return [sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--layout", "ps-per-node",
            "--port-base", str(free_port_base(8)), "--startup-timeout", "600", str(script)], env


def run_job(workdir: Path, side: str, task: str, model: str, examples: int, epochs: int, batch: int,
            seeds: list[int]) -> list[dict[str, Any]]:
    """One launch of a side; the chief's (or the single process') runs, one per seed."""
    argv, env = command(workdir, side)
    argv += [side, task, model, str(examples), str(epochs), str(batch), ",".join(map(str, seeds))]
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: its servers and workers too
        out, _ = proc.communicate()
        raise SystemExit(f"{side} {task} {model}: timed out after {TIMEOUT:g} s:\n"
                         + last_lines(out, workdir, proc.pid)) from None
    results = [line.split(RESULT_PREFIX, 1)[1] for line in out.splitlines() if RESULT_PREFIX in line]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{side} {task} {model} failed (exit {proc.returncode}): {' '.join(argv)}\n"
                         + last_lines(out, workdir, proc.pid))
    return json.loads(results[-1])


def last_lines(out: str, workdir: Path, launcher: int, count: int = 40) -> str:
    """The job's last lines (a repeated line once), then the end of every process log with a traceback."""
    lines: list[str] = []
    for line in out.splitlines():
        if not lines or line != lines[-1]:
            lines.append(line)
    text = "\n".join(lines[-count:])
    for log in sorted((workdir / "keras_distrib-logs" / f"local-{launcher}").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-count:]
        if any("Traceback" in line for line in tail):
            text += f"\n--- the end of {log.name}:\n" + "\n".join(tail)
    return text


def steps_per_sec(stats: list[dict[str, Any]]) -> float:
    """The median steps/s of epochs 2.. (epoch 1 compiles); of epoch 1 if it is the only one."""
    timed = stats[1:] or stats
    return statistics.median(s["steps_per_sec"] for s in timed)


def throughput(args: Any, workdir: Path, model: str, name: str) -> tuple[list[Comparison], dict[str, list[float]]]:
    """A (JAX ps) vs B (TF ps) and vs C (one JAX process), sides rotated round by round."""
    rounds = 1 if args.smoke else args.rounds
    examples = 1024 if args.smoke else args.examples or EXAMPLES.get(name, DEFAULT_EXAMPLES)
    epochs = 2 if args.smoke else args.epochs
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(rounds):
        order = list(SIDES[i % len(SIDES):] + SIDES[: i % len(SIDES)])
        if i % 2:
            order.reverse()
        for side in order:
            runs = run_job(workdir, side, "throughput", model, examples, epochs, args.batch, [0])
            rates[side].append(steps_per_sec(runs[0]["stats"]))
        print(f"  {name} round {i + 1}/{rounds} ({', '.join(order)}): "
              + ", ".join(f"{side} {rates[side][-1]:.1f}" for side in SIDES) + " steps/s", file=sys.stderr, flush=True)
    where = f"{name}, 2 workers + 2 ps, {examples} rows, batch {args.batch}"
    vs_tf = Comparison(f"JAX ps vs TF ps trainer {where}", "JAX ps", "TF ps", "steps/s",
                       rates["jax_ps"], rates["tf_ps"], target=">= 1.0")
    vs_single = Comparison(f"JAX ps vs one JAX process (distribution cost) {where}", "JAX ps", "one JAX process",
                           "steps/s", list(rates["jax_ps"]), rates["single"], target="(report)")
    kernels = Comparison(f"one JAX process vs one TF process (the backends' own kernels) {name}", "one JAX process",
                         "one TF process", "steps/s", list(rates["single"]), rates["single_tf"], target="(report)")
    return [vs_tf, vs_single, kernels], rates


def accuracy(args: Any, workdir: Path, model: str, name: str) -> tuple[Comparison, list[float]]:
    """Test accuracy per seed: the JAX ps job vs one JAX process; and the differences in points."""
    seeds = list(range(1 if args.smoke else args.seeds))
    epochs = 2 if args.smoke else ACCURACY_EPOCHS
    sides = {}
    for side in ("jax_ps", "single"):
        sides[side] = [run["accuracy"] for run in run_job(workdir, side, "accuracy", model, 0, epochs, args.batch, seeds)]
    points = [100 * (a - b) for a, b in zip(sides["jax_ps"], sides["single"])]
    print(f"  {name} accuracy per seed: JAX ps {sides['jax_ps']}, one process {sides['single']}, "
          f"difference {', '.join(f'{p:+.2f}' for p in points)} points", file=sys.stderr, flush=True)
    row = Comparison(f"accuracy {name}: JAX ps vs one JAX process (digits, {epochs} epochs, seeds {seeds[0]}-{seeds[-1]})",
                     "JAX ps", "one JAX process", "test accuracy", sides["jax_ps"], sides["single"],
                     target="within 1 point")
    return row, points


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(rounds=3)
    p.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn, module:fn, file.py:fn")
    p.add_argument("--batch", type=int, default=64, help="examples per optimizer update (default 64)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per throughput run; epochs 2.. are timed")
    p.add_argument("--examples", type=int, default=None, help="training rows (default per model)")
    p.add_argument("--accuracy", action="store_true", help="the accuracy rows in a --smoke run too")
    p.add_argument("--seeds", type=int, default=3, help="accuracy seeds (default 3; a --smoke run: 1)")
    args = p.parse_args()
    models = ["mlp"] if args.smoke else args.models.split(",")
    comparisons: list[Comparison] = []
    extra: dict[str, Any] = {"batch": args.batch, "steps_per_sec": {}, "accuracy_points": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            name = model.rpartition(":")[2]
            where = model.rpartition(":")[0]
            if where.endswith(".py"):  # the jobs run in another directory
                model = f"{Path(where).resolve()}:{name}"
            rows, rates = throughput(args, Path(tmp), model, name)
            comparisons += rows
            extra["steps_per_sec"][name] = rates
            if args.accuracy or not args.smoke:
                row, points = accuracy(args, Path(tmp), model, name)
                comparisons.append(row)
                extra["accuracy_points"][name] = points
    print_table("Parameter servers on JAX (local mode, ps-per-node, 2 nodes)", comparisons)
    for name, points in extra["accuracy_points"].items():
        mean = statistics.mean(points)
        print(f"accuracy {name}: JAX ps - one process = {mean:+.2f} points (mean over {len(points)} seed(s); "
              f"{'within' if math.fabs(mean) <= 1 else 'NOT within'} 1 point)")
    save("jax_ps_throughput", comparisons, extra, out=args.out)


if __name__ == "__main__":
    main()
