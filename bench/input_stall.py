"""Input stall: the fraction of step time the workers wait for input (issue #5 benchmark 8).

    python bench/input_stall.py [--smoke] [--rounds 5] [--models mlp,cnn] [--batch 64] [--k 10]
                                [--layouts 1ps2w,2w] [--cores N] [--stage-cores 1,2]

Method (throughput difference, end to end): `keras_distrib.fit` (K=10) trains the same
model, in each layout of ``--layouts`` (1ps2w: parameter-server trainer, chief + 2 workers
+ 1 ps; 1ps1w: ps-per-node, 1 worker; 2w: all-reduce trainer, 2 workers), on
  A1 = in-memory arrays (`keras_distrib.data.ArraySource`: shard -> shuffle -> repeat ->
       batch -> prefetch on every worker),
  A2 = TFRecord files (`keras_distrib.data.FileSource`, 4 files of tf.train.Examples) in
       three recipes: ``files`` = batch-then-parse (``parse_batch=tf.io.parse_example``,
       the docs/data.md recipe); ``files_per_record`` = ``parse=tf.io.parse_single_example``;
       ``files_cache`` = per-record parse with ``cache=True``,
  B  = one pre-materialised batch cached in memory and repeated (no per-step input work),
alternated round by round in one cluster. A/B is the share of B's throughput kept, and
stall fraction = 1 - A/B: the part of each step's time spent waiting for input rather than
computing or talking to the ps. A negative stall means no measurable stall (noise).

Per-stage breakdown (where the input time goes): each prefix of one worker's file pipeline
(read; read + per-record parse; read + batch-then-parse; the whole pipeline; cached; arrays)
is timed alone, without training, in a process pinned to 1 and to 2 cores (``--stage-cores``;
bench/_input_stages.py), as microseconds per batch. With the training's consumption
(steps/s x batch examples) this gives the cores the input needs, and 1 vs 2 cores shows what
more cores give the pipeline. ``--cores N`` pins the whole benchmark (every training
process) to N cores, to measure the stall itself on a smaller node.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import Comparison, child_env, print_table, save
from _train_jobs import each_model, model_runs, training_parser

STEPS = {"mlp": 400, "cnn": 160}
DEFAULT_STEPS = 160
LAYOUT_NAMES = {"1ps2w": "ps, 2 workers", "1ps1w": "ps, 1 worker", "2w": "all-reduce, 2 workers"}
KINDS = {"arrays": "ArraySource", "files": "FileSource batch-then-parse",
         "files_per_record": "FileSource per-record parse", "files_cache": "FileSource cached"}
#: The stage of bench/_input_stages.py that is each training side's whole pipeline.
STAGE_OF_KIND = {"arrays": "pipeline arrays", "files": "pipeline parse_batch",
                 "files_per_record": "pipeline per-record", "files_cache": "pipeline cached"}
HERE = Path(__file__).resolve().parent


def pin_cores(count: int) -> list[int]:
    """Restrict this process (and every child it starts) to its first ``count`` CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:count]
    os.sched_setaffinity(0, cpus)
    return cpus


def stage_times(model: str, batch: int, batches: int, examples: int, cores: int) -> dict[str, float]:
    """{stage: us per batch} from bench/_input_stages.py pinned to ``cores`` CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "stages.json"
        cmd = [sys.executable, str(HERE / "_input_stages.py"), "--model", model, "--batch", str(batch),
               "--batches", str(batches), "--examples", str(examples), "--workdir", tmp, "--result", str(result)]
        proc = subprocess.run(cmd, env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                              timeout=600, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        if proc.returncode != 0:
            raise SystemExit(f"stage breakdown failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


def main() -> None:
    p = training_parser(__doc__)
    p.add_argument("--layouts", default="1ps2w,2w", help="comma-separated: " + ", ".join(LAYOUT_NAMES))
    p.add_argument("--cores", type=int, default=None, help="pin the whole benchmark to this many CPUs")
    p.add_argument("--stage-cores", default="1,2", help="CPU counts for the per-stage breakdown")
    args = p.parse_args()
    if args.cores:
        print(f"  pinned to CPUs {pin_cores(args.cores)}", file=sys.stderr)
    rounds, runs = model_runs(args, STEPS, DEFAULT_STEPS)
    layouts = ["1ps2w"] if args.smoke else args.layouts.split(",")
    # --smoke: the batch-then-parse recipe only, stages on one core count (seconds, not minutes).
    kinds = {k: v for k, v in KINDS.items() if not args.smoke or k == "files"}
    sides = [f"pipeline_{k}" for k in kinds] + ["cached_batch"]
    stage_cores = sorted({min(int(c), len(os.sched_getaffinity(0))) for c in args.stage_cores.split(",")})
    stage_cores = stage_cores[:1] if args.smoke else stage_cores
    comparisons: list[Comparison] = []
    raw: dict[str, dict[str, list[float]]] = {}
    stall: dict[str, float] = {}
    stages: dict[str, dict[int, dict[str, float]]] = {}
    for name, run in each_model(args, rounds, runs):
        spec = next(m for m, n, _, _ in runs if n == name)
        stages[name] = {c: stage_times(spec, args.batch, 5 if args.smoke else 400, 1024 if args.smoke else 4096, c)
                        for c in stage_cores}
        for layout in layouts:
            # One process alone (the chief, servers idle) gives the step's pure compute; the
            # all-reduce workers all run the script, so that layout reuses a ps layout's.
            extra = [] if layout == "2w" else ["single_process"]
            r = raw[f"{name} {layout}"] = run(layout, sides + extra)
            for kind, label in kinds.items():
                c = Comparison(f"8. input {kind} {name} {layout}", label, "cached batch", "steps/s",
                               r[f"pipeline_{kind}"], r["cached_batch"], target="stall = 1 - A/B")
                comparisons.append(c)
                stall[c.name] = 1 - statistics.median(c.ratios)
    print_table(f"Input stall, keras_distrib.fit (batch {args.batch}, K={args.k}, {rounds} rounds"
                + (f", pinned to {args.cores} cores" if args.cores else "") + ")", comparisons)
    for key, value in stall.items():
        print(f"  {key}: stall fraction {value:.3f} (1 - median A/B)")
    need = print_stages(stages, raw, args.batch)
    save("input_stall", comparisons, {"batch": args.batch, "k": args.k, "models": [run[0] for run in runs],
                                      "layouts": layouts, "cores": args.cores, "stall_fraction": stall,
                                      "steps_per_sec": raw, "stage_us_per_batch": stages,
                                      "input_cores_needed": need}, args.out)
    plot_stages(stages, args.out)
    profile = step_profile(raw)
    for run, parts in profile.items():
        print(f"  step profile {run}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
    plot_step_profile(profile, args.out)
    data = json.loads((args.out / "input_stall.json").read_text())
    (args.out / "input_stall.json").write_text(json.dumps(data | {"step_profile_ms": profile}, indent=2))


def print_stages(stages: dict[str, dict[int, dict[str, float]]], raw: dict[str, dict[str, list[float]]],
                 batch: int) -> dict[str, float]:
    """Print the per-stage table and, per run, the CPU cores its input needs; return the latter."""
    from _input_stages import STAGES

    need: dict[str, float] = {}
    for name, by_cores in stages.items():
        cores = sorted(by_cores)
        print(f"\nPer-stage input cost, {name}, one worker's shard (us per batch of {batch}; "
              f"alone, no training; {' vs '.join(map(str, cores))} cores):")
        for stage, what in STAGES:
            cells = "  ".join(f"{by_cores[c][stage]:8.0f}" for c in cores)
            print(f"  {stage:22s} {cells}   {what}")
        one = by_cores[cores[0]]
        for run, rates in raw.items():
            if not run.startswith(name + " "):
                continue
            steps = statistics.median(rates["cached_batch"])  # consumption when input is free
            for kind, stage in STAGE_OF_KIND.items():
                need[f"{run} {kind}"] = steps * one[stage] / 1e6
            print(f"  {run}: at {steps:.0f} steps/s the input needs "
                  + ", ".join(f"{need[f'{run} {k}']:.2f} ({k})" for k in KINDS) + " cores")
    return need


def step_profile(raw: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """{run: {part: ms of wall time per step}} from the medians of one run's sides.

    compute = one process alone, same model and batch (``single_process``; all-reduce runs
    take their model's ps run's); distribution = the cached-batch step minus that (ps:
    variable reads, gradient sends, closure scheduling; all-reduce: the collective; on a
    shared machine also the CPU the other processes take); input wait = the FileSource
    (batch-then-parse) step minus the cached-batch step. Negative differences print as 0.
    """
    def ms(rates: list[float]) -> float:
        return 1000.0 / statistics.median(rates)

    out: dict[str, dict[str, float]] = {}
    for run, sides in raw.items():
        model = run.split()[0]
        alone = sides.get("single_process") or next(
            (r["single_process"] for k, r in raw.items() if k.split()[0] == model and "single_process" in r), None)
        if alone is None or "pipeline_files" not in sides:
            continue
        compute, cached, files = ms(alone), ms(sides["cached_batch"]), ms(sides["pipeline_files"])
        out[run] = {"compute": compute, "distribution": max(cached - compute, 0.0),
                    "input wait": max(files - cached, 0.0)}
    return out


def plot_step_profile(profile: dict[str, dict[str, float]], out: Path) -> None:
    """step_profile.png: one stacked bar per (model, layout) of where a step's wall time goes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not profile:
        return
    runs = list(profile)
    labels = [f"{r.split()[0]}\n{LAYOUT_NAMES.get(r.split()[1], r.split()[1])}" for r in runs]
    fig, ax = plt.subplots(figsize=(8.5, 1.0 + 0.75 * len(runs)))
    left = [0.0] * len(runs)
    for part, color in (("compute", "tab:blue"), ("distribution", "tab:orange"), ("input wait", "tab:red")):
        widths = [profile[r][part] for r in runs]
        ax.barh(labels, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds of wall time per training step (median over rounds)")
    ax.set_title("Where a step's time goes: keras_distrib.fit, FileSource input", fontsize=11)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.tick_params(labelsize=9)
    fig.tight_layout()
    fig.savefig(out / "step_profile.png", dpi=100)
    plt.close(fig)


def plot_stages(stages: dict[str, dict[int, dict[str, float]]], out: Path) -> None:
    """input_stall_stages.png: one panel per model, bars per stage, one bar per core count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from _input_stages import STAGES

    names = list(stages)
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        cores = sorted(stages[name])
        width = 0.8 / len(cores)
        labels = [s for s, _ in STAGES]
        for i, c in enumerate(cores):
            ax.barh([y + i * width for y in range(len(labels))], [stages[name][c][s] for s in labels],
                    height=width, label=f"{c} core{'s' if c > 1 else ''}")
        ax.set_yticks([y + width * (len(cores) - 1) / 2 for y in range(len(labels))], labels, fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("microseconds per batch (one worker's pipeline, alone)")
        ax.set_title(f"Input pipeline stages, {name}", fontsize=11)
        ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "input_stall_stages.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
