"""Synchronous (all-reduce) training throughput: issue #5 benchmark 3.

    python bench/sync_throughput.py [--smoke] [--rounds 5] [--models mlp,cnn] [--batch 64] [--k 10]

A = the Keras 3 all-reduce trainer (`keras_distrib.fit` under MultiWorkerMirroredStrategy,
K=10 steps per tf.function call, its default) vs B = tf_keras `model.fit` under the same
MultiWorkerMirroredStrategy at its default (steps_per_execution=1). Target: A/B >= 1.0.
Extra row, no target: B = tf_keras with steps_per_execution=K.

Cluster: 2 all-reduce workers (`python -m keras_distrib.local --nodes 2 --layout allreduce`),
each running bench/_train_jobs.py in lockstep; worker 0 reports. Same model, same
synthetic data, same global batch (split over the two workers; tf_keras input from a
DatasetCreator sharded by input pipeline). Per model one launcher run; inside it every
side alternates round by round, each round a fit of 2 epochs of S steps with epoch 2
timed. Ratios are of steps/s, median and min-max over rounds.
"""

from __future__ import annotations


from _harness import Comparison, print_table, save
from _train_jobs import each_model, model_runs, training_parser

#: Steps per timed epoch: about 1-2 s of training per side on the 2-core machine.
STEPS = {"mlp": 150, "cnn": 50}
DEFAULT_STEPS = 50


def main() -> None:
    args = training_parser(__doc__).parse_args()
    rounds, runs = model_runs(args, STEPS, DEFAULT_STEPS)
    comparisons: list[Comparison] = []
    raw: dict[str, dict[str, list[float]]] = {}
    for name, run in each_model(args, rounds, runs):
        r = raw[name] = run("2w", ["keras_distrib", "tf_keras", "tf_keras_k"])
        comparisons += [
            Comparison(f"3. sync throughput {name}", "keras_distrib", "tf_keras fit", "steps/s",
                       r["keras_distrib"], r["tf_keras"], target=">= 1.0"),
            Comparison(f"3b. vs tuned tf_keras {name}", "keras_distrib", f"tf_keras fit spe={args.k}", "steps/s",
                       r["keras_distrib"], r["tf_keras_k"], target="(info)"),
        ]
    print_table(f"Synchronous throughput, MultiWorkerMirroredStrategy, 2 workers "
                f"(global batch {args.batch}, K={args.k}, {rounds} rounds)", comparisons)
    save("sync_throughput", comparisons, {"batch": args.batch, "k": args.k, "models": [run[0] for run in runs],
                                          "steps_per_sec": raw}, args.out)


if __name__ == "__main__":
    main()
