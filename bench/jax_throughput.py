"""The jax layout's training throughput (issue 13).

    python bench/jax_throughput.py [--smoke] [--rounds 5] [--models mlp,cnn] [--batch 64] [--steps S]

A = plain `model.fit` of Keras 3 on JAX over 2 processes (`--layout jax`, local mode,
`keras_distrib.distribution()`, CPU, gloo), against
B1 = the same `model.fit` in one JAX process, and
B2 = the TensorFlow all-reduce trainer (`keras_distrib.fit`, 2 workers, `--layout allreduce`),
B3 = the bare reference: the same `model.fit` on 2 JAX processes started by this program with
     plain `jax.distributed.initialize` + `keras.distribution.DataParallel` (Keras' own dataset
     sharding), without this project's launcher or layer: A/B3 is what is ours, B3/B1 what
     JAX's CPU collectives cost,
A10 = A with `steps_per_execution=10` in `compile` (what the TF trainers do by default).
Same model (bench/_train_jobs.py), same synthetic data, same global batch. Each round
launches every side afresh (JAX and TensorFlow cannot share a process), in alternating
order; a side runs fit with epochs=2 and steps_per_epoch=S and times epoch 2 only (no
compilation). Ratios are of steps/s (one step = one global batch), median and min-max.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import REPO, Comparison, child_env, parser, print_table, save  # noqa: E402

STEPS = {"mlp": 150, "cnn": 40}
EXAMPLES = 8192
RESULT_PREFIX = "JAX_THROUGHPUT "
SIDES = ("jax", "bare", "jax_spe10", "single", "allreduce")


def run_bare(job: list[str]) -> subprocess.CompletedProcess:
    """The bare reference: 2 JAX processes joined by jax.distributed.initialize, no launcher."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, *job], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", BARE_COORDINATOR=f"127.0.0.1:{port}",
                                            BARE_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [proc.communicate(timeout=900) for proc in procs]
    code = next((proc.returncode for proc in procs if proc.returncode), 0)
    return subprocess.CompletedProcess(procs[0].args, code, outs[0][0], outs[0][1] + outs[1][1])


def run_side(side: str, model: str, batch: int, steps: int) -> float:
    """steps/s of one side, from a fresh launch."""
    job = [str(Path(__file__).resolve()), "--side", side, "--model", model, "--batch", str(batch), "--steps", str(steps)]
    if side == "bare":
        proc = run_bare(job)
    elif side == "single":
        argv, env = [sys.executable, *job], child_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    else:
        layout = "allreduce" if side == "allreduce" else "jax"
        argv = [sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--layout", layout, *job]
        env = child_env(JAX_PLATFORMS="cpu")
    if side != "bare":
        proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    results = [line.split(RESULT_PREFIX, 1)[1] for line in proc.stdout.splitlines() if RESULT_PREFIX in line]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"side {side} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return float(json.loads(results[-1])["steps_per_sec"])


def side_main(args: argparse.Namespace) -> None:
    """Inside a job (or alone for ``single``): train and print steps/s from the reporting process."""
    import keras
    import tensorflow as tf

    import keras_distrib
    from _train_jobs import MODELS, compile_model, epoch_timer, synthetic

    reports = True
    if args.side in ("jax", "jax_spe10"):
        keras_distrib.distribution()
        reports = keras_distrib.cluster().is_chief
    elif args.side == "bare":
        import os

        import jax

        jax.distributed.initialize(coordinator_address=os.environ["BARE_COORDINATOR"], num_processes=2,
                                   process_id=int(os.environ["BARE_PROCESS_ID"]))
        keras.utils.set_random_seed(0)
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        reports = jax.process_index() == 0
    strategy = keras_distrib.strategy() if args.side == "allreduce" else None
    model_fn = MODELS[args.model]
    x, y = synthetic(model_fn, EXAMPLES)
    timer = epoch_timer(keras.callbacks.Callback)
    if strategy is not None:
        from keras_distrib.trainers import placement

        model = placement.build(lambda: compile_model(model_fn(keras), keras), strategy)
        keras_distrib.fit(model, (x, y), epochs=2, steps_per_epoch=args.steps, batch_size=args.batch, verbose=0,
                          callbacks=[timer], strategy=strategy)
        reports = keras_distrib.cluster().is_chief
    else:
        model = compile_model(model_fn(keras), keras, **({"steps_per_execution": 10} if args.side == "jax_spe10" else {}))
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=0).repeat().batch(args.batch)
        model.fit(data, epochs=2, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    if reports:
        print(RESULT_PREFIX + json.dumps({"steps_per_sec": args.steps / timer.seconds[-1]}), flush=True)


def jax_bench_args(doc: str, sides: tuple[str, ...], timed: str) -> argparse.Namespace:
    """The flags of the jax benchmarks (this one and jax_step_breakdown.py); --side/--model run one job."""
    p = parser(doc)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per {timed} (default per model)")
    p.add_argument("--side", choices=sides, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = jax_bench_args(__doc__, SIDES, "side")
    if args.side:
        side_main(args)
        return
    rounds = 1 if args.smoke else args.rounds
    models = ["mlp"] if args.smoke else args.models.split(",")
    comparisons: list[Comparison] = []
    for name in models:
        steps = 5 if args.smoke else args.steps or STEPS.get(name, 50)
        vs_single = Comparison(f"jax layout vs one process {name}", "jax 2 processes", "jax 1 process", "steps/s",
                               target="(report)")
        vs_tf = Comparison(f"jax layout vs TF all-reduce {name}", "jax 2 processes", "TF allreduce 2 workers",
                           "steps/s", target=">= 1.0, or ours within 10 % of bare")
        vs_bare = Comparison(f"jax layout vs bare jax.distributed + DataParallel {name}", "jax 2 processes",
                             "bare 2 processes", "steps/s", target=">= 0.9")
        bare_single = Comparison(f"bare 2 processes vs one process {name} (JAX's own distribution cost)",
                                 "bare 2 processes", "jax 1 process", "steps/s", target="(report)")
        spe = Comparison(f"jax layout steps_per_execution=10 vs 1 {name}", "jax spe=10", "jax 2 processes", "steps/s",
                         target="(report)")
        spe_tf = Comparison(f"jax layout steps_per_execution=10 vs TF all-reduce {name}", "jax spe=10",
                            "TF allreduce 2 workers", "steps/s", target="(report)")
        for i in range(rounds):
            measured: dict[str, float] = {}
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                measured[side] = run_side(side, name, args.batch, steps)
            for c, a, b in ((vs_single, "jax", "single"), (vs_tf, "jax", "allreduce"), (vs_bare, "jax", "bare"),
                            (bare_single, "bare", "single"), (spe, "jax_spe10", "jax"), (spe_tf, "jax_spe10", "allreduce")):
                c.a.append(measured[a])
                c.b.append(measured[b])
            print(f"  {name} round {i + 1}/{rounds}: " + " ".join(f"{k}={v:.4g}" for k, v in measured.items())
                  + " steps/s", file=sys.stderr, flush=True)
        comparisons += [vs_single, vs_tf, vs_bare, bare_single, spe, spe_tf]
    print_table(f"jax layout throughput (global batch {args.batch}, {rounds} rounds, CPU)", comparisons)
    save("jax_throughput", comparisons, {"batch": args.batch, "models": models}, args.out)


if __name__ == "__main__":
    main()
