"""Synchronous (all-reduce) training throughput: issue #5 benchmark 3.

    python bench/sync_throughput.py [--smoke] [--rounds 5] [--models mlp,cnn] [--batch 64] [--k 10]

A = the Keras 3 all-reduce trainer (`keras_distrib.fit` under MultiWorkerMirroredStrategy,
K=10 steps per tf.function call, its default) vs B = tf_keras `model.fit` under the same
MultiWorkerMirroredStrategy at its default (steps_per_execution=1). Target: A/B >= 1.0.
Extra rows: B = tf_keras with steps_per_execution=K (no target); 3c, the same trainer
without ``steps_per_epoch`` (one exact pass per epoch, as ``fit(x, y, epochs=...)``)
against it with ``steps_per_epoch`` (issue 27: within 5 %), for arrays, a ``tf.data`` of
known size and a `FileSource` (4 TFRecord files; batch-then-parse, and per-record parse
with ``cache=True``); ``--exact-epochs-only``: those sides alone.

Cluster: 2 all-reduce workers (`python -m keras_distrib.local --nodes 2 --layout allreduce`),
each running bench/_train_jobs.py in lockstep; worker 0 reports. Same model, same
synthetic data, same global batch (split over the two workers; tf_keras input from a
DatasetCreator sharded by input pipeline). Per model one launcher run; inside it every
side alternates round by round, each round a fit of one untimed epoch of S steps (the
FileSource sides: two, the first counts the shards) and ``--timed-epochs`` timed ones (default
3). Ratios are of steps/s, median and min-max over rounds.
"""

from __future__ import annotations

from typing import Any, Callable

from _harness import Comparison
from _train_jobs import EXACT_EPOCH_PAIRS, EXACT_EPOCH_SIDES, throughput_main, timed_epochs

#: Steps per timed epoch: about 1-2 s of training per side on the 2-core machine.
STEPS = {"mlp": 150, "cnn": 50}
DEFAULT_STEPS = 50


def compare(args: Any, name: str, run: Callable[..., dict[str, list[float]]]) -> tuple[list[Comparison], dict[str, Any]]:
    sides = EXACT_EPOCH_SIDES if args.exact_epochs_only else ["tf_keras", "tf_keras_k", *EXACT_EPOCH_SIDES]
    r = run("2w", sides)
    exact = [
        Comparison(f"3c. exact epochs vs steps_per_epoch {name}, {kind}", "exact epochs", "steps_per_epoch",
                   "steps/s", r[exact_side], r[base], target=">= 0.95")
        for kind, exact_side, base in EXACT_EPOCH_PAIRS
    ]
    if args.exact_epochs_only:
        return exact, {name: r}
    return [
        Comparison(f"3. sync throughput {name}", "keras_distrib", "tf_keras fit", "steps/s",
                   r["keras_distrib"], r["tf_keras"], target=">= 1.0"),
        Comparison(f"3b. vs tuned tf_keras {name}", "keras_distrib", f"tf_keras fit spe={args.k}", "steps/s",
                   r["keras_distrib"], r["tf_keras_k"], target="(info)"),
        *exact,
    ], {name: r}


def main() -> None:
    throughput_main(__doc__, "sync_throughput", STEPS, DEFAULT_STEPS, compare,
                    lambda args, rounds: f"Synchronous throughput, MultiWorkerMirroredStrategy, 2 workers "
                                         f"(global batch {args.batch}, K={args.k}, {rounds} rounds of "
                                         f"{timed_epochs(args)} timed epochs)",
                    lambda p: p.add_argument("--exact-epochs-only", action="store_true",
                                             help="only issue 27's sides (exact epochs)"),
                    timed_epochs=3)


if __name__ == "__main__":
    main()
