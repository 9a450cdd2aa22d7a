"""Hangs: from a freeze (SIGSTOP) to the line naming the frozen process, and to training
progressing again, per kind of process; and the hang watchdog's cost on steps/s.

    python bench/hang.py [--smoke] [--rounds 3] [--hang-timeout 10]

Local mode, 2 emulated nodes, the MLP of bench/recovery.py (batch 32, K=10 steps per
closure), checkpoints every second. A process is frozen once training runs; the launcher
runs with a short --hang-timeout (the default, 300 s, would only add 290 s to each figure).
* named: seconds from the SIGSTOP to the agent's line naming that process (the timeout
  plus the watchdog's poll, or, for an all-reduce worker, its peer's exit that names it);
* back: seconds from the SIGSTOP to the first completed closure after the restart.
* Cost: steps/s of a whole run with the watchdog (default --hang-timeout) vs without
  (--hang-timeout 0); and the counter's own cost per scheduled function (keras_distrib.progress.tick)
  against an empty call, in nanoseconds. --smoke measures only the latter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import timeit
from pathlib import Path

from _harness import Comparison, parser, print_table, save
from recovery import finish, progress_lines, task_pid
from recovery import launch as recovery_launch

KINDS = {  # kind -> (layout, task frozen)
    "worker (ps layout)": ("ps-per-node", "worker:1"),
    "ps": ("ps-per-node", "ps:1"),
    "allreduce worker": ("allreduce", "worker:1"),
}


def launch(workdir: Path, layout: str, epochs: int, steps: int, hang_timeout: float | None) -> tuple[subprocess.Popen[str], Path, list[tuple[float, str]]]:
    """bench/recovery.py's job, checkpoints every second, with ``--hang-timeout`` when given."""
    extra = ["--hang-timeout", str(hang_timeout)] if hang_timeout is not None else []
    return recovery_launch(workdir, layout, "1s", epochs, steps, extra)


def freeze(workdir: Path, kind: str, epochs: int, steps: int, hang_timeout: float) -> tuple[float, float]:
    """(seconds from the SIGSTOP to the naming line, to progress again)."""
    layout, task = KINDS[kind]
    proc, progress, lines = launch(workdir, layout, epochs, steps, hang_timeout)
    deadline = time.monotonic() + 600
    while len(progress_lines(progress)) < 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = task_pid(proc.pid, task)
    if pid is None:
        proc.kill()
        raise SystemExit(f"{task} not found")
    frozen = time.time()
    os.kill(pid, signal.SIGSTOP)
    finish(proc, lines, kind)
    named = [t for t, text in lines if t > frozen and f"{task} on local1" in text
             and ("made no progress" in text or "stopped sending heartbeats" in text)]
    if not named:
        raise SystemExit(f"{task} was never named:\n" + "\n".join(text for _, text in lines[-30:]))
    after = [t for _, t in progress_lines(progress) if t > named[0]]
    if not after:
        raise SystemExit(f"no progress after {task} was named: raise the steps")
    return named[0] - frozen, after[0] - frozen


def rate(workdir: Path, hang_timeout: float | None, epochs: int, steps: int) -> float:
    proc, _, lines = launch(workdir, "ps-per-node", epochs, steps, hang_timeout)
    finish(proc, lines, f"training with --hang-timeout {hang_timeout}")
    return [float(text.rsplit(" ", 1)[1]) for _, text in lines if "] RATE " in text][-1]


def tick_cost(number: int = 200_000) -> tuple[float, float]:
    """Nanoseconds per progress.tick() (a mapped counter) and per empty call."""
    from keras_distrib import contract, progress

    with tempfile.TemporaryDirectory() as tmp:
        os.environ[contract.PROGRESS_FILE_VAR] = str(Path(tmp) / "progress")
        progress.reset()
        tick = min(timeit.repeat(progress.tick, number=number, repeat=5)) / number * 1e9
        del os.environ[contract.PROGRESS_FILE_VAR]
        progress.reset()

    def empty() -> None:
        pass

    return tick, min(timeit.repeat(empty, number=number, repeat=5)) / number * 1e9


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--hang-timeout", type=float, default=10.0, help="--hang-timeout of the freeze runs (default 10)")
    args = p.parse_args()
    rounds = 1 if args.smoke else args.rounds
    comparisons = []
    tick = Comparison("progress.tick() vs an empty call", "tick", "empty call", "ns")
    for _ in range(rounds):
        a, b = tick_cost()
        tick.a.append(a)
        tick.b.append(b)
    comparisons.append(tick)
    if not args.smoke:
        epochs, steps = 3, 1000
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for kind in KINDS:
                c = Comparison(f"hang: {kind} (--hang-timeout {args.hang_timeout:g})", "freeze -> named",
                               "freeze -> progress", "s")
                for i in range(rounds):
                    named, back = freeze(work, kind, epochs, steps, args.hang_timeout)
                    c.a.append(named)
                    c.b.append(back)
                    print(f"  {kind} round {i + 1}/{rounds}: named after {named:.1f} s, progress after {back:.1f} s", flush=True)
                comparisons.append(c)
            cost = Comparison("steps/s, watchdog on (default) vs off", "on", "off", "steps/s", target="> 0.99")
            for i in range(rounds):
                order = ((None, cost.a), (0.0, cost.b)) if i % 2 == 0 else ((0.0, cost.b), (None, cost.a))
                for hang_timeout, sink in order:
                    sink.append(rate(work, hang_timeout, epochs, steps))
                print(f"  cost round {i + 1}/{rounds}: {cost.a[-1]:.1f} vs {cost.b[-1]:.1f} steps/s", flush=True)
            comparisons.append(cost)
    print_table("Hangs: freeze -> named -> progress, and the watchdog's cost (local mode, 2 emulated nodes)", comparisons)
    save("hang", comparisons, {}, args.out)


if __name__ == "__main__":
    main()
