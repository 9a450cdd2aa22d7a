"""Where a step of the jax layout goes (issue 27 §2): input, the compiled step, the collective,
and Keras' and our Python, against the bare reference.

    python bench/jax_step_breakdown.py [--smoke] [--rounds 3] [--models mlp,cnn] [--batch 64]

Three jobs per round, each timing the same things in its reporting process (ms per step of
one global batch, CPU):
* ``ours``: 2 processes under the launcher (`--layout jax`, `keras_distrib.distribution()`);
* ``bare``: 2 processes started by this program with plain `jax.distributed.initialize` +
  `keras.distribution.DataParallel` (no launcher, no layer of ours);
* ``single``: one JAX process with half the global batch: the compute of one process's share,
  with no collective.
In each job:
* ``fit``: `model.fit` on a `tf.data` pipeline, epoch 2 of 2 timed (no compilation);
* ``input``: Keras' own epoch iterator over the same pipeline, alone: `tf.data` reads the
  global batch, each process keeps its slice (Keras' `distribute_dataset`) and puts it on its
  device (`distribute_data_input`, `jax.make_array_from_process_local_data`), blocked on;
* ``step``: the compiled train step (`model.train_function`) on one batch already on the
  device, blocked on at the end: compute plus, in 2 processes, the gradients' all-reduce.
Derived: collective = step (2 processes) - step (single); fit - step = what the input and
Keras' and our Python per step add beyond the compiled step (JAX dispatches the step
asynchronously, so fit overlaps part of the input with it: input alone may exceed that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import REPO, Comparison, child_env, print_table, save  # noqa: E402
from jax_throughput import EXAMPLES, STEPS, jax_bench_args, run_bare  # noqa: E402

PREFIX = "JAX_BREAKDOWN "
SIDES = ("ours", "bare", "single")
PARTS = ("fit", "input", "step")


def run_side(side: str, model: str, batch: int, steps: int) -> dict[str, float]:
    """ms per step of each part, from one fresh job of ``side``."""
    job = [str(Path(__file__).resolve()), "--side", side, "--model", model, "--batch", str(batch), "--steps", str(steps)]
    if side == "bare":
        proc = run_bare(job)
    else:
        if side == "single":
            argv, env = [sys.executable, *job], child_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
        else:
            argv = [sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--layout", "jax", *job]
            env = child_env(JAX_PLATFORMS="cpu")
        proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    rows = [line.split(PREFIX, 1)[1] for line in proc.stdout.splitlines() if PREFIX in line]
    if proc.returncode != 0 or not rows:
        raise SystemExit(f"side {side} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(rows[-1])


def side_main(args: argparse.Namespace) -> None:
    """Inside a job: build, time fit, the input alone and the compiled step alone."""
    import os

    import jax
    import keras
    import tensorflow as tf

    from _train_jobs import MODELS, compile_model, epoch_timer, synthetic

    batch, reports = args.batch, True
    if args.side == "ours":
        import keras_distrib

        keras_distrib.distribution()
        reports = keras_distrib.cluster().is_chief
    elif args.side == "bare":
        jax.distributed.initialize(coordinator_address=os.environ["BARE_COORDINATOR"], num_processes=2,
                                   process_id=int(os.environ["BARE_PROCESS_ID"]))
        keras.utils.set_random_seed(0)
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        reports = jax.process_index() == 0
    else:
        batch //= 2  # one process's share of the global batch
    model_fn = MODELS[args.model]
    x, y = synthetic(model_fn, EXAMPLES)
    model = compile_model(model_fn(keras), keras)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=0).repeat().batch(batch)
    timer = epoch_timer(keras.callbacks.Callback)
    model.fit(data, epochs=2, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    result = {"fit": 1e3 * timer.seconds[-1] / args.steps}

    from keras.src.backend.jax.trainer import JAXEpochIterator

    def input_pass() -> tuple[float, object]:
        iterator = JAXEpochIterator(x=data, steps_per_epoch=args.steps, steps_per_execution=1)
        started, last = time.perf_counter(), None
        for _, _, batches in iterator:
            last = next(batches)
            jax.block_until_ready(last)
        return time.perf_counter() - started, last

    input_pass()  # warm: the iterator's first use builds its pipeline
    seconds, on_device = input_pass()
    result["input"] = 1e3 * seconds / args.steps

    # The step donates its state: one state, carried through the warm-up and the timed steps.
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    for timed in (False, True):
        started = time.perf_counter()
        for _ in range(args.steps):
            _, state = model.train_function(state, iter([on_device]))
        jax.block_until_ready(state)
    result["step"] = 1e3 * (time.perf_counter() - started) / args.steps
    if reports:
        print(PREFIX + json.dumps(result), flush=True)


def main() -> None:
    args = jax_bench_args(__doc__, SIDES, "part")
    if args.side:
        side_main(args)
        return
    rounds = 1 if args.smoke else args.rounds
    models = ["mlp"] if args.smoke else args.models.split(",")
    comparisons: list[Comparison] = []
    breakdown: dict[str, dict[str, dict[str, float]]] = {}
    for name in models:
        steps = 5 if args.smoke else args.steps or STEPS.get(name, 50)
        measured: dict[str, dict[str, list[float]]] = {side: {part: [] for part in PARTS} for side in SIDES}
        for i in range(rounds):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                for part, ms in run_side(side, name, args.batch, steps).items():
                    measured[side][part].append(ms)
            print(f"  {name} round {i + 1}/{rounds}: " + "; ".join(
                f"{side} " + " ".join(f"{part}={measured[side][part][-1]:.2f}" for part in PARTS) for side in SIDES)
                + " ms/step", file=sys.stderr, flush=True)
        m = {side: {part: statistics.median(v) for part, v in parts.items()} for side, parts in measured.items()}
        breakdown[name] = m
        for part in PARTS:
            c = Comparison(f"{name} {part}: ours vs bare", "ours", "bare", "ms/step", target="(report)")
            c.a, c.b = measured["ours"][part], measured["bare"][part]
            comparisons.append(c)
        c = Comparison(f"{name} step: bare 2 processes vs one process's share alone (the collective)", "bare",
                       "single", "ms/step", target="(report)")
        c.a, c.b = measured["bare"]["step"], measured["single"]["step"]
        comparisons.append(c)
    print_table(f"jax layout step breakdown (global batch {args.batch}, {rounds} rounds, CPU; ms per step)",
                comparisons)
    for name, m in breakdown.items():
        print(f"{name}, medians in ms per global step:")
        for side in SIDES:
            fit, inp, step = (m[side][part] for part in PARTS)
            print(f"  {side:6s}  fit {fit:6.2f} = compiled step {step:5.2f} + input and Python not hidden behind "
                  f"it {fit - step:5.2f}   (input alone {inp:5.2f})")
        print(f"  collective and sharding (bare step - single step): {m['bare']['step'] - m['single']['step']:.2f}")
    save("jax_step_breakdown", comparisons, {"batch": args.batch, "models": models, "medians": breakdown}, args.out)


if __name__ == "__main__":
    main()
