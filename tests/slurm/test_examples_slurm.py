"""The repository's examples on the real 3-node Slurm cluster, as docs/getting-started.md and docs/schedulers.md show them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_cluster import SlurmTestCluster
from test_launcher_slurm import LAUNCH, NODES, PS_PER_NODE, REPO, TIMEOUT, assert_nothing_left, error_lines, meaningful, sbatch_template

DIGITS = REPO / "examples" / "digits_distrib.py"


def result_line(lines: list[str], prefix: str) -> dict:
    payloads = [line.split("] ", 1)[1] for line in lines if line.startswith(prefix) and "] {" in line]
    assert payloads, "\n".join(lines[-30:])
    return json.loads(payloads[-1])


def test_digits_example_through_the_sbatch_template(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    """The ps-per-node template on 3 nodes: a ps and a worker serve on every node, the chief
    trains and saves, and nothing (process or port) is left once the job ends."""
    out, model = tmp_path / "digits.out", tmp_path / "digits.keras"
    job = sbatch_template(slurm_cluster, PS_PER_NODE, ["-N3", "--cpus-per-task=2", "-o", str(out)],
                          [str(DIGITS), "--epochs", "4", "--json", "--save", str(model)], tmp_path)
    result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED" and result.exit_code == 0, text
    lines = meaningful(text)
    for i, node in enumerate(NODES):
        for role in (f"ps:{i}", f"worker:{i}"):
            assert any(line.startswith(f"[{node} {role}] serving {role} at {node}:") for line in lines), role
    summary = result_line(lines, "[n1 chief:0]")
    assert summary["test_accuracy"] > 0.85
    assert summary["steps"] > 0
    assert model.exists()
    assert error_lines(text) == []
    assert_nothing_left(slurm_cluster, job)


def test_digits_example_allreduce_through_srun(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    run = slurm_cluster.head(
        # --verbose: worker 1 is quiet by default, and its result line is compared here.
        ["srun", "-N2", "--ntasks-per-node=1", "--cpus-per-task=2", *LAUNCH, "--layout", "allreduce", "--verbose",
         str(DIGITS), "--epochs", "3", "--json"],
        cwd=tmp_path, timeout=TIMEOUT,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text
    lines = meaningful(text)
    first = result_line(lines, "[n1 worker:0]")
    second = result_line(lines, "[n2 worker:1]")
    assert (first["test_accuracy"], first["steps"]) == (second["test_accuracy"], second["steps"]), \
        "all-reduce workers must end with identical results"
    assert first["test_accuracy"] > 0.8
    assert_nothing_left(slurm_cluster)


TUNER_TEMPLATE = REPO / "scripts" / "sbatch" / "tuner.sbatch"
TUNER_EXAMPLE = REPO / "examples" / "digits_tuner.py"


def test_a_kerastuner_search_through_the_sbatch_template(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    """The tuner template on 2 nodes (no GPUs: one trial worker each): KerasTuner's oracle on n1,
    every trial ended, trials run on both nodes, the best trial printed, nothing left."""
    pytest.importorskip("keras_tuner", reason="the [tuner] extra (keras-tuner) is not installed")
    out = tmp_path / "tuner.out"
    job = sbatch_template(slurm_cluster, TUNER_TEMPLATE, ["-N2", "--cpus-per-task=2", "-o", str(out)],
                          [str(TUNER_EXAMPLE), "--trials", "4", "--epochs", "2", "--json",
                           "--directory", str(tmp_path / "search")], tmp_path)
    result = slurm_cluster.wait_job(job, timeout=TIMEOUT)
    text = out.read_text(errors="replace")
    assert result == "COMPLETED" and result.exit_code == 0, text
    lines = meaningful(text)
    ended = [line for line in lines if line.startswith("[n1 chief:0] keras_distrib: trial ")]
    assert len(ended) == 4, text
    assert {line.split(" on ", 1)[1].split(":", 1)[0] for line in ended} == {"tuner0 (n1)", "tuner1 (n2)"}, text
    assert result_line(lines, "[n1 chief:0]")["trials"] == 4
    assert error_lines(text) == []
    assert_nothing_left(slurm_cluster, job)
