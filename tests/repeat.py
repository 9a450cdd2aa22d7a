"""Run the exact-epoch, recovery and freeze tests of both trainers N times in a row, to hunt
rare failures instead of patching them where they show (docs/development.md, Flakes).

    python tests/repeat.py --runs 20                 # the default tests, 20 runs
    python tests/repeat.py --runs 5 -k counted       # a subset (pytest's -k)
    python tests/repeat.py --runs 3 tests/local/test_ps_trainer.py

Each run is one pytest process over the chosen files with its own seed: PYTHONHASHSEED and
KERAS_DISTRIB_TEST_SEED are the seed (the base ``--seed`` plus the run's number), so a
failing run is replayed with ``--seed S --runs 1``. Every run's output is kept in
``--log-dir``; a failure prints the run, its seed, its failed tests and its log. The last
line is the tally, ``N passed, M failed`` (runs, not tests).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The tests that exercise exact epochs, recovery from a dead process, and freezes, in the
#: parameter-server and all-reduce layouts.
DEFAULT_TESTS = (
    "tests/local/test_exact_epochs.py",
    "tests/local/test_resilience_local.py",
    "tests/local/test_hangs_local.py",
)


def run_once(tests: list[str], seed: int, keyword: str | None, log: Path, timeout: float) -> tuple[bool, list[str]]:
    """One pytest run; (passed, the ids of the failed tests)."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rf", *tests]
    if keyword:
        argv += ["-k", keyword]
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "KERAS_DISTRIB_TEST_SEED": str(seed)}
    with log.open("w") as out:
        try:
            code = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\nrepeat.py: the run did not end within {timeout:g} s\n")
            return False, [f"(timed out after {timeout:g} s)"]
    failed = re.findall(r"^FAILED (\S+)", log.read_text(errors="replace"), re.MULTILINE)
    return code == 0, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="test files (default: %(default)s)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="the first run's seed (default: from the clock)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--log-dir", type=Path, default=Path("repeat-logs"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for one run")
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    for i in range(args.runs):
        seed = args.seed + i
        log = args.log_dir / f"run-{i + 1:03d}-seed-{seed}.log"
        started = time.perf_counter()
        ok, failed = run_once(args.tests, seed, args.keyword, log, args.timeout)
        seconds = time.perf_counter() - started
        if ok:
            print(f"run {i + 1}/{args.runs} seed {seed}: passed ({seconds:.0f} s)", flush=True)
            continue
        failures += 1
        print(f"run {i + 1}/{args.runs} seed {seed}: FAILED ({seconds:.0f} s), log {log}", flush=True)
        for test in failed or ["(no test named: see the log)"]:
            print(f"    {test}", flush=True)
    print(f"{args.runs - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
