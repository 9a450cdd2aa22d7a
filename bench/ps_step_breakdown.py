"""Where a parameter-server step goes: issue 15 §2's breakdown of the distribution cost.

    python bench/ps_step_breakdown.py [--smoke] [--rounds 3] [--models mlp,cnn] [--batch 64] [--k 10]
                                      [--exact-epochs-only]

Runs in the cluster of ps_throughput.py's row 4 (chief + 1 ps + 1 worker, ps-per-node,
one node) and alternates, round by round inside one job, five sides training the same
model on the same data (bench/_train_jobs.py):

* ``single_process``: plain Keras 3 ``model.fit`` in the chief alone (the reference);
* ``ps_chunk_compute``: K unrolled steps per scheduled closure, model and Adam on the
  worker itself: compute only;
* ``ps_chunk_read``: + the variables read packed from the ps once per step (Adam still
  updates a worker-local copy, so the steps stay sequential);
* ``ps_chunk_read_send``: the gradients sent back packed and Adam applied on the ps instead;
* ``keras_distrib``: the full trainer (`keras_distrib.fit`, trainers/ps/), with
  ``steps_per_epoch`` (the input repeats: no guard per step);
* ``keras_distrib_exact_epochs``: the same without ``steps_per_epoch``, one exact pass
  per epoch over as many batches (arrays: handed out in parts of K known steps);
* ``keras_distrib_tf_data``: ``keras_distrib`` with the examples as an unbatched
  ``tf.data`` of known size (``from_tensor_slices``), ``steps_per_epoch`` (repeated);
* ``keras_distrib_exact_epochs_tf_data``: the same tf.data without ``steps_per_epoch``
  (a numbered stream, parts of K known steps): issue 27's pair is this and the one above;
* ``keras_distrib_files`` / ``keras_distrib_exact_epochs_files``: the examples as 4 TFRecord
  files (`FileSource`, batch-then-parse), with and without ``steps_per_epoch`` (fixed
  shards, counted in the first epoch); ``..._files_cache``: per-record parse, ``cache=True``;
* ``keras_distrib_stale_reads``: the same with the opt-in ``ps_stale_reads=True`` (one
  variable read per closure; changes the training semantics, see docs/training.md);
* ``keras_distrib_local_steps``: the same with the opt-in ``ps_local_steps=True`` (K local
  steps per closure, one read and one packed update of weights and optimizer state;
  exactly sequential training with this one worker, see docs/training.md);
* ``keras_distrib_local_steps_2k``: the same with 2K steps per closure (half the
  synchronisations; the single-process reference keeps K).

Rows: each side's steps/s against one process, then the step time split into its
increments (compute, variable read, gradient send + apply, trainer bookkeeping =
closure scheduling and the exact-step/metrics/epoch work), in ms per step from the
per-round medians, and the chief's CPU time per closure (time.process_time in the chief
over the timed epochs; single_process's is the whole training's). ``--exact-epochs-only``:
only the ``keras_distrib`` sides of issue 27's rows (with and without ``steps_per_epoch``,
arrays, tf.data and files), so more rounds fit in the same time. Each side's round times 3
epochs after an untimed one (``--timed-epochs``; one epoch's rate varies by about 15 %,
issue 27's pairs differ by a few).
"""

from __future__ import annotations

import statistics
import sys

from _harness import Comparison, print_table, save
from _train_jobs import (EXACT_EPOCH_PAIRS, EXACT_EPOCH_SIDES, each_model, launch_result, model_runs, timed_epochs,
                         training_parser)
from ps_throughput import STEPS

SIDES = ["single_process", "ps_chunk_compute", "ps_chunk_read", "ps_chunk_read_send", *EXACT_EPOCH_SIDES,
         "keras_distrib_stale_reads", "keras_distrib_local_steps", "keras_distrib_local_steps_2k"]
#: Sides that run more than K steps per closure (a factor of K).
K_FACTOR = {"keras_distrib_local_steps_2k": 2}
#: (label of the increment, side with it, side without it)
INCREMENTS = [
    ("compute (worker, local variables)", "ps_chunk_compute", None),
    ("+ packed variable read from the ps", "ps_chunk_read", "ps_chunk_compute"),
    ("+ packed gradient send and apply on the ps (- local apply)", "ps_chunk_read_send", "ps_chunk_read"),
    ("+ trainer bookkeeping (step counter, metrics, epochs, chief)", "keras_distrib", "ps_chunk_read_send"),
    ("+ exact epochs (no steps_per_epoch)", "keras_distrib_exact_epochs", "keras_distrib"),
    ("+ tf.data (from_tensor_slices) instead of arrays", "keras_distrib_tf_data", "keras_distrib"),
    ("+ exact epochs of that tf.data (no steps_per_epoch)", "keras_distrib_exact_epochs_tf_data", "keras_distrib_tf_data"),
]


def breakdown(rates: dict[str, list[float]], cpu: dict[str, list[float]], k: int) -> list[str]:
    """Readable lines: ms per step by increment, closures/s and chief CPU per closure."""
    ms = {side: 1000 / statistics.median(r) for side, r in rates.items()}
    lines = [f"    one process (plain fit): {ms['single_process']:.2f} ms/step"]
    for label, side, base in INCREMENTS:
        delta = ms[side] - (ms[base] if base else 0.0)
        lines.append(f"    {label}: {delta:+.2f} ms/step (total {ms[side]:.2f})")
    for side in SIDES[1:]:
        closures = statistics.median(rates[side]) / (k * K_FACTOR.get(side, 1))
        chief = statistics.median(cpu.get(side, [float("nan")]))
        lines.append(f"    {side}: {closures:.1f} closures/s, chief CPU {chief:.2f} ms per closure "
                     f"({chief * closures / 10:.0f}% of a core)")
    return lines


def main() -> None:
    p = training_parser(__doc__, timed_epochs=3)  # issue 27's pairs differ by a few %, one epoch by ~15 %
    p.add_argument("--exact-epochs-only", action="store_true", help="only issue 27's sides (exact epochs)")
    args = p.parse_args()
    rounds, runs = model_runs(args, STEPS, 240)
    comparisons: list[Comparison] = []
    raw: dict[str, dict] = {}
    text: list[str] = []
    for name, run in each_model(args, rounds, runs, launcher=launch_result):
        result = run("1ps1w", EXACT_EPOCH_SIDES if args.exact_epochs_only else SIDES)
        rates, cpu = result["sides"], result["chief_cpu_ms_per_closure"]
        raw[name] = {"steps_per_sec": rates, "chief_cpu_ms_per_closure": cpu}
        if not args.exact_epochs_only:
            comparisons += [
                Comparison(f"13. step breakdown {name}: {side}", side, "one process", "steps/s",
                           rates[side], rates["single_process"], target="(report)")
                for side in SIDES[1:]
            ]
        # Issue 27 §1: exact epochs against the same fit with steps_per_epoch, per input kind.
        comparisons += [
            Comparison(f"27. exact epochs {name}, {kind}: without vs with steps_per_epoch", "exact epochs",
                       "steps_per_epoch", "steps/s", rates[exact], rates[base], target=">= 0.95")
            for kind, exact, base in EXACT_EPOCH_PAIRS
        ]
        if not args.exact_epochs_only:
            text += [f"  {name} (median of {rounds} rounds):", *breakdown(rates, cpu, args.k)]
    print_table(f"Parameter-server step breakdown (batch {args.batch}, K={args.k}, {rounds} rounds of "
                f"{timed_epochs(args)} timed epochs, "
                "chief + 1 ps + 1 worker vs one process)", comparisons)
    print("\n".join(text))
    save("ps_step_breakdown", comparisons, {"batch": args.batch, "k": args.k, "timed_epochs": timed_epochs(args),
                                            "breakdown": text, **raw}, args.out)


if __name__ == "__main__":
    sys.exit(main())
