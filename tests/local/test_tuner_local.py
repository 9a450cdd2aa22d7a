"""Layout tuner in local mode: KerasTuner's own script (examples/digits_tuner.py) searches on
2 and 3 emulated nodes; every trial ends, the trials spread over the workers, a search stopped
by the time-limit warning resumes from its directory, a trial worker and then the oracle killed
mid-search are restarted, and nothing is left running. The best
trial matches a single-process search over the same space within noise."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from docs_blocks import command_lines
from keras_distrib.contract import PREEMPTED_EXIT_CODE
from launcher_utils import REPO, Job, alive, launcher_env, wait_for

pytest.importorskip("keras_tuner", reason="the [tuner] extra (keras-tuner) is not installed")

EXAMPLE = REPO / "examples" / "digits_tuner.py"
TRIALS, EPOCHS = 6, 3
ENDED = re.compile(r"\[local0 chief:0\] keras_distrib: trial (\d+) (\w+) on (tuner\d+) \(local\d\): val_accuracy")


def search(tmp_path: Path, nodes: int, *options: str, script_args: tuple[str, ...] = (), trials: int = TRIALS,
           **env: str) -> Job:
    """docs/tuner.md's command, as a newcomer types it, on ``nodes`` nodes, with ``options``."""
    [command] = command_lines("tuner-local")
    assert command[:3] == ["python", "-m", "keras_distrib.local"] and command[-1] == "examples/digits_tuner.py"
    args = command[3:-1]
    args[args.index("--nodes") + 1] = str(nodes)
    return Job([*args, *options, str(EXAMPLE), "--trials", str(trials), "--epochs", str(EPOCHS), "--json",
                "--directory", str(tmp_path / "search"), *script_args], tmp_path, **env)


def ended(job: Job) -> list[tuple[str, str, str]]:
    return [m.groups() for line in job.lines if (m := ENDED.match(line))]


def best(job: Job) -> dict:
    rows = [json.loads(line.split("] ", 1)[1]) for line in job.lines if '] {"best_score"' in line]
    assert len(rows) == 1, job.text()[-3000:]
    return rows[0]


def running(job: Job, nodes: int) -> bool:
    """Wait until every process of the search runs, noting their PIDs (checked gone at the end)."""
    tasks = ["chief:0"] + [f"tuner:{i}" for i in range(nodes)]
    return wait_for(lambda: all([job.pids(task) for task in tasks]), 120)


def test_a_search_on_two_nodes_stopped_by_a_time_limit_warning_resumes_and_ends_as_one_process_would(
        tmp_path: Path) -> None:
    first = search(tmp_path, 2)
    assert running(first, 2), first.text()[-3000:]
    assert wait_for(lambda: len(ended(first)) >= 2, 300), first.text()[-3000:]
    first.proc.send_signal(signal.SIGUSR1)  # what the sbatch template's trap passes on before the time limit
    assert first.wait(120) == PREEMPTED_EXIT_CODE, first.text()[-3000:]
    for proc in ("chief:0 on local0", "tuner:0 on local0", "tuner:1 on local1"):  # each stopped, none killed
        assert first.count(f"{proc} finished with exit code {PREEMPTED_EXIT_CODE}") == 1, (proc, first.text()[-3000:])
    assert not alive(sorted(first.seen)), "a process of the stopped search outlived it"
    before = {int(t) for t, _, _ in ended(first)}
    job = search(tmp_path, 2)  # the requeued job: the same command in the same directory
    assert running(job, 2), job.text()[-3000:]
    assert job.wait(600) == 0, job.text()[-3000:]
    done = ended(job)
    assert {status for _, status, _ in done} == {"completed"}
    assert before | {int(t) for t, _, _ in done} == set(range(TRIALS)), (before, done)
    assert len(before & {int(t) for t, _, _ in done}) <= 2, f"the resumed search ran ended trials again: {done}"
    assert len({worker for _, _, worker in ended(first) + done}) == 2, "one worker ran every trial"
    assert not alive(sorted(job.seen)), "a process of the search outlived it"
    logs = next((tmp_path / "keras_distrib-logs").glob("local-*"))
    assert {p.name for p in logs.glob("*.log")} >= {"chief-0.log", "tuner-0.log", "tuner-1.log"}
    assert not [line for line in job.lines if line.startswith("[local0 tuner:")], "trial workers are quiet"
    # The same space and seed in one process: the oracle proposes the same trials, training noise aside.
    single = subprocess.run([sys.executable, str(EXAMPLE), "--trials", str(TRIALS), "--epochs", str(EPOCHS), "--json",
                             "--directory", str(tmp_path / "single")], cwd=tmp_path, env=launcher_env(),
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-2000:]
    alone = json.loads(single.stdout.strip().splitlines()[-1])
    distributed = best(job)
    assert distributed["trials"] == alone["trials"] == TRIALS and distributed["backend"] == "tensorflow"
    assert abs(distributed["best_score"] - alone["best_score"]) <= 0.03, (distributed, alone)


def test_on_jax_a_frozen_and_a_killed_trial_worker_then_the_oracle_killed_restart_and_the_search_ends(
        tmp_path: Path) -> None:
    """Three nodes on Keras' JAX backend: tuner:2 frozen (SIGSTOP) is named by the watchdog and
    restarted, tuner:1 killed mid-trial is restarted, then the oracle killed restarts the search."""
    pytest.importorskip("jax", reason="the [jax] extra is not installed")
    # More trials than the others: with 6, the two healthy workers once ended the search while the
    # frozen one was being named, before the kill that follows (seen in CI).
    trials = 2 * TRIALS
    job = search(tmp_path, 3, "--hang-timeout", "5", KERAS_BACKEND="jax", script_args=("--summary",), trials=trials)
    assert running(job, 3), job.text()[-3000:]
    assert wait_for(lambda: ended(job), 300), job.text()[-3000:]
    subprocess.run(["kill", "-STOP", str(job.pids("tuner:2")[0])], check=True)
    assert wait_for(lambda: job.count("tuner:2 on local2 made no progress for"), 120), job.text()[-3000:]
    job.kill("tuner:1")
    assert wait_for(lambda: job.count("tuner:1 on local1 exited with signal 9"), 60), job.text()[-3000:]
    job.kill("chief:0")
    assert job.wait(600) == 0, job.text()[-3000:]
    for line in ("tuner:1 on local1 exited with signal 9 (SIGKILL); restarting it; the oracle gives it its trial "
                 "again (2/3)",
                 "chief:0 on local0 exited with signal 9 (SIGKILL); restarting it and all 3 trial workers; the search "
                 "resumes from its directory, the running trials again (3/3)"):
        assert job.count(line) == 1, (line, job.text()[-3000:])
    frozen = [line for line in job.lines if "tuner:2 on local2 made no progress for" in line]
    assert frozen and "restarting it; the oracle gives it its trial again (1/3)" in frozen[0], frozen
    done = ended(job)
    # A trial the oracle had not yet marked ended when it was killed runs again: at least once each.
    assert {int(t) for t, _, _ in done} == set(range(trials)), job.text()[-3000:]
    assert len({worker for _, _, worker in done}) >= 2
    assert best(job)["trials"] == trials and best(job)["backend"] == "jax"
    # Each worker's own code after its search asked the oracle for the results, and got them.
    logs = next((tmp_path / "keras_distrib-logs").glob("local-*"))
    for worker in range(3):
        assert "Results summary" in (logs / f"tuner-{worker}.log").read_text(), f"tuner-{worker}.log"
    assert len(job.seen) >= 4 and not alive(sorted(job.seen)), "a process of the search outlived it"
