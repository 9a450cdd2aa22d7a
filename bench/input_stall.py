"""Input stall: the fraction of step time the workers wait for input (issue #5 benchmark 8).

    python bench/input_stall.py [--smoke] [--rounds 5] [--models mlp,cnn] [--batch 64] [--k 10]

Method (throughput difference, end to end): the Keras 3 async trainer (`keras_distrib.fit`,
chief + 2 workers + 1 ps, K=10) trains the same model on
  A1 = the real sharded pipeline for in-memory arrays (`keras_distrib.data.ArraySource`:
       shard -> shuffle -> repeat -> batch -> prefetch on every worker),
  A2 = the real sharded pipeline for files (`keras_distrib.data.FileSource` over 4 TFRecord
       files of tf.train.Examples, parsed with a parallel map, then the same steps),
  B  = one pre-materialised batch cached in memory and repeated (no per-step input work),
alternated round by round in one cluster. A/B is the share of B's throughput kept, and
stall fraction = 1 - A/B: the part of each step's time that is spent waiting for input
rather than computing or talking to the ps. (tf.data's own stats cannot say this: the
prefetch buffer hides production time that does not stall the step.) Both layouts shard
with the same `keras_distrib.data.pipeline`; this measures the parameter-server one.
A negative stall means no measurable stall (noise).
"""

from __future__ import annotations

import statistics

from _harness import Comparison, print_table, save
from _train_jobs import each_model, model_runs, training_parser

STEPS = {"mlp": 400, "cnn": 160}
DEFAULT_STEPS = 160


def main() -> None:
    args = training_parser(__doc__).parse_args()
    rounds, runs = model_runs(args, STEPS, DEFAULT_STEPS)
    comparisons: list[Comparison] = []
    raw: dict[str, dict[str, list[float]]] = {}
    stall: dict[str, float] = {}
    for name, run in each_model(args, rounds, runs):
        r = raw[name] = run("1ps2w", ["pipeline_arrays", "pipeline_files", "cached_batch"])
        for kind, label in (("arrays", "ArraySource"), ("files", "FileSource")):
            c = Comparison(f"8. input {kind} {name}", label, "cached batch", "steps/s",
                           r[f"pipeline_{kind}"], r["cached_batch"], target="stall = 1 - A/B")
            comparisons.append(c)
            stall[c.name] = 1 - statistics.median(c.ratios)
    print_table(f"Input stall, parameter-server trainer, chief + 2 workers + 1 ps "
                f"(batch {args.batch}, K={args.k}, {rounds} rounds)", comparisons)
    for key, value in stall.items():
        print(f"  {key}: stall fraction {value:.3f} (1 - median A/B)")
    save("input_stall", comparisons, {"batch": args.batch, "k": args.k, "models": [run[0] for run in runs],
                                      "stall_fraction": stall, "steps_per_sec": raw}, args.out)


if __name__ == "__main__":
    main()
