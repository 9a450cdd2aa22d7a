"""Time and peak memory of `--plan --format json` for 10 to 10,000 SLURM nodes.

    python bench/plan_scaling.py [--smoke] [--rounds 5]

Each size runs as its own interpreter (start-up included), like a user's srun task.
Ratios are against the 10-node plan measured in the same round. TensorFlow is never
imported on this path; the program checks that too.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from _harness import Comparison, child_env, parser, print_table, save

SIZES = (10, 100, 1000, 10000)


def run_plan_measured(nodes: int) -> tuple[float, float]:
    """Like run_plan, but reaps the child with wait4 to read its own peak RSS."""
    width = len(str(nodes))
    env = child_env(
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST=f"n[{1:0{width}d}-{nodes:0{width}d}]",
        SLURM_STEP_TASKS_PER_NODE=f"1(x{nodes})",
        SLURM_STEP_NUM_TASKS=str(nodes),
        SLURM_PROCID="0",
    )
    code = (
        "import runpy, sys\n"
        "sys.argv = ['keras_distrib.slurm', '--plan', '--format', 'json']\n"
        "try:\n    runpy.run_module('keras_distrib.slurm', run_name='__main__')\n"
        "finally:\n    assert 'tensorflow' not in sys.modules, 'the plan path imported TensorFlow'\n"
    )
    out_path = f"/tmp/kd-plan-{os.getpid()}.json"
    start = time.perf_counter()
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=out, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    with open(out_path, "rb") as fh:
        text = fh.read()
    os.unlink(out_path)
    if os.waitstatus_to_exitcode(status) != 0 or f'"n{nodes:0{width}d}"'.encode() not in text:
        raise SystemExit(f"plan for {nodes} nodes failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return elapsed, usage.ru_maxrss / 1024


def main() -> None:
    args = parser(__doc__).parse_args()
    sizes = SIZES[:2] if args.smoke else SIZES
    rounds = 1 if args.smoke else args.rounds
    seconds = {n: Comparison(f"plan {n} vs 10 nodes", f"{n} nodes", "10 nodes", "s") for n in sizes if n != 10}
    memory: dict[int, list[float]] = {n: [] for n in sizes}
    times: dict[int, list[float]] = {}
    for i in range(rounds):
        for n in sizes:
            t_n, rss = run_plan_measured(n)
            memory[n].append(rss)
            times.setdefault(n, []).append(t_n)
            if n != 10:
                t_10, _ = run_plan_measured(10)
                seconds[n].a.append(t_n)
                seconds[n].b.append(t_10)
            print(f"  round {i + 1}/{rounds}: {n} nodes {t_n:.3f} s, {rss:.1f} MiB peak", file=sys.stderr, flush=True)
    comparisons = list(seconds.values())
    print_table("Plan scaling: `python -m keras_distrib.slurm --plan --format json` (interpreter start included)", comparisons)
    for n in sizes:
        print(f"  {n:>6} nodes: median {statistics.median(times[n]):.3f} s, peak RSS {max(memory[n]):.1f} MiB")
    save("plan_scaling", comparisons, {"seconds": {str(n): times[n] for n in sizes},
                                       "peak_rss_mib": {str(n): memory[n] for n in sizes}}, args.out)


if __name__ == "__main__":
    main()
