"""Parameter-server training throughput: issue #5 benchmarks 1, 2 and 4.

    python bench/ps_throughput.py [--smoke] [--rounds 5] [--models mlp,cnn] [--batch 64] [--k 10]

1. PS throughput (target >= 2.0): A = the Keras 3 async trainer (`keras_distrib.fit`,
   K=10 steps per scheduled function, its default) vs B = tf_keras `model.fit` under
   ParameterServerStrategy at its default (steps_per_execution=1; tf_keras refuses batch
   callbacks under PSS, so epochs are timed with an epoch callback on both sides).
   Extra row, no target: B = tf_keras with steps_per_execution=K, the tuned alternative.
2. Trainer overhead (target >= 0.95): A = the same trainer vs B = a minimal hand-written
   ClusterCoordinator loop running the same K steps per scheduled tf.function
   (GradientTape + Keras 3 Adam, no metrics, closures scheduled then joined; the K steps
   in a `tf.range` loop). Extra row 2b, no target: B = the same loop with the K steps
   unrolled (a Python `range`), which the trainer also does; the trainer additionally
   packs each ps's variables into one transfer per step (keras_distrib/trainers/packing.py).
4. Distribution cost (reported): A = the async trainer with 1 worker + 1 ps vs B = plain
   Keras 3 `model.fit` (steps_per_execution=K, same tf.data input) in one process.

Cluster for 1 and 2: chief + 2 workers + 1 ps (local mode, worker-per-gpu layout of one
emulated node with two GPU ids; TensorFlow finds no GPU and runs on the CPU). For 4:
chief + 1 ps + 1 worker (`--nodes 1`, ps-per-node), B running inside the idle chief.

Each model gets one launcher run per cluster; inside it the chief builds one model per
side and alternates the sides round by round (rotated order), every side training the
same architecture on the same synthetic data with the same batch. Per round and side:
fit with 2 epochs of S steps, epoch 2 timed (see bench/_train_jobs.py). Ratios are of
steps/s, median and min-max over rounds. --model also takes `module:fn` / `file.py:fn`
where fn(keras) builds an uncompiled logits model with the given Keras module.
"""

from __future__ import annotations

from typing import Any, Callable

from _harness import Comparison
from _train_jobs import throughput_main

#: Steps per timed epoch: about 2-4 s of training per side on the 2-core machine (shorter
#: epochs made the per-round ratios swing by +-20%).
STEPS = {"mlp": 600, "cnn": 240}
DEFAULT_STEPS = 240


def compare(args: Any, name: str, run: Callable[..., dict[str, list[float]]]) -> tuple[list[Comparison], dict[str, Any]]:
    sides = ["keras_distrib", "tf_keras", "tf_keras_k", "hand_loop", "hand_loop_unrolled"]
    if args.smoke:  # every side once, in one cluster: proves the program, measures nothing
        two = one = run("1ps2w", sides + ["single_process"])
    else:
        two = run("1ps2w", sides)
        one = run("1ps1w", ["keras_distrib", "single_process"])
    return [
        Comparison(f"1. PS throughput {name}", "keras_distrib", "tf_keras fit", "steps/s",
                   two["keras_distrib"], two["tf_keras"], target=">= 2.0"),
        Comparison(f"1b. vs tuned tf_keras {name}", "keras_distrib", f"tf_keras fit spe={args.k}", "steps/s",
                   two["keras_distrib"], two["tf_keras_k"], target="(info)"),
        Comparison(f"2. trainer overhead {name}", "keras_distrib", "hand loop", "steps/s",
                   two["keras_distrib"], two["hand_loop"], target=">= 0.95"),
        Comparison(f"2b. vs unrolled hand loop {name}", "keras_distrib", "hand loop, unrolled", "steps/s",
                   two["keras_distrib"], two["hand_loop_unrolled"], target="(info)"),
        Comparison(f"4. distribution cost {name}", "1 worker + 1 ps", "one process", "steps/s",
                   one["keras_distrib"], one["single_process"], target="(report)"),
    ], {f"{name} 2 workers": two, f"{name} 1 worker": one}


def main() -> None:
    throughput_main(__doc__, "ps_throughput", STEPS, DEFAULT_STEPS, compare,
                    lambda args, rounds: f"Parameter-server throughput (batch {args.batch}, K={args.k}, {rounds} rounds, "
                                         "chief + 2 workers + 1 ps; row 4: 1 worker + 1 ps vs one process)")


if __name__ == "__main__":
    main()
