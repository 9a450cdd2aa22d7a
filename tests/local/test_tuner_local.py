"""Layout tuner in local mode: KerasTuner's own script (examples/digits_tuner.py) searches on
2 and 3 emulated nodes; every trial ends, the trials spread over the workers, a trial worker
killed mid-search is restarted and its trial run again, and nothing is left running. The best
trial matches a single-process search over the same space within noise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_utils import REPO, Job, alive, launcher_env, wait_for

pytest.importorskip("keras_tuner", reason="the [tuner] extra (keras-tuner) is not installed")

EXAMPLE = REPO / "examples" / "digits_tuner.py"
TRIALS, EPOCHS = 6, 3
ENDED = re.compile(r"\[local0 chief:0\] keras_distrib: trial (\d+) (\w+) on (tuner\d+): val_accuracy")


def search(tmp_path: Path, nodes: int) -> Job:
    return Job(["--nodes", str(nodes), "--layout", "tuner", str(EXAMPLE), "--trials", str(TRIALS),
                "--epochs", str(EPOCHS), "--json", "--directory", str(tmp_path / "search")], tmp_path)


def ended(job: Job) -> list[tuple[str, str, str]]:
    return [m.groups() for line in job.lines if (m := ENDED.match(line))]


def best(job: Job) -> dict:
    rows = [json.loads(line.split("] ", 1)[1]) for line in job.lines if '] {"best_score"' in line]
    assert len(rows) == 1, job.text()[-3000:]
    return rows[0]


def every_task_gone(job: Job, tasks: list[str]) -> bool:
    for task in tasks:
        job.pids(task)
    return not alive(sorted(job.seen))


def test_a_search_on_two_nodes_ends_every_trial_spread_over_its_workers_as_one_process_would(tmp_path: Path) -> None:
    job = search(tmp_path, 2)
    assert wait_for(lambda: job.pids("tuner:1"), 120), job.text()[-3000:]
    assert job.wait(600) == 0, job.text()[-3000:]
    done = ended(job)
    assert sorted(int(t) for t, _, _ in done) == list(range(TRIALS)), job.text()[-3000:]
    assert {status for _, status, _ in done} == {"completed"}
    assert len({worker for _, _, worker in done}) == 2, f"one worker ran every trial: {done}"
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
    assert distributed["trials"] == alone["trials"] == TRIALS
    assert abs(distributed["best_score"] - alone["best_score"]) <= 0.03, (distributed, alone)


def test_a_trial_worker_killed_mid_search_on_three_nodes_is_restarted_and_its_trial_ends(tmp_path: Path) -> None:
    job = search(tmp_path, 3)
    assert wait_for(lambda: ended(job), 300), job.text()[-3000:]
    job.kill("tuner:1")
    assert job.wait(600) == 0, job.text()[-3000:]
    restarted = [line for line in job.lines if "tuner:1 on local1 exited with signal 9 (SIGKILL); restarting it; "
                 "the oracle gives it its trial again (1/3)" in line]
    assert len(restarted) == 1, job.text()[-3000:]
    done = ended(job)
    assert sorted(int(t) for t, _, _ in done) == list(range(TRIALS)), job.text()[-3000:]
    assert len({worker for _, _, worker in done}) >= 2
    assert best(job)["trials"] == TRIALS
    assert every_task_gone(job, ["chief:0", "tuner:0", "tuner:1", "tuner:2"])
