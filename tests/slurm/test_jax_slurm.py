"""The jax layout on the real 3-node Slurm cluster: Keras 3 on JAX (CPU, gloo) with plain model.fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_cluster import SlurmTestCluster
from test_launcher_slurm import LAUNCH, REPO, TIMEOUT, assert_nothing_left, meaningful

pytest.importorskip("jax", reason="the [jax] extra is not installed")

DIGITS_JAX = REPO / "examples" / "digits_jax.py"


def test_digits_jax_through_srun(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    model = tmp_path / "digits.keras"
    run = slurm_cluster.head(
        ["srun", "-N2", "--ntasks-per-node=1", "--cpus-per-task=2", *LAUNCH, "--layout", "jax",
         str(DIGITS_JAX), "--epochs", "3", "--json", "--save", str(model)],
        env={"JAX_PLATFORMS": "cpu"}, cwd=tmp_path, timeout=TIMEOUT,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-5000:]
    lines = meaningful(text)
    results = [json.loads(line.split("] ", 1)[1]) for line in lines if line.startswith("[n1 worker:0] {")]
    assert results and results[-1]["test_accuracy"] > 0.8, "\n".join(lines[-40:])
    assert not any(line.startswith("[n2 worker:1] {") for line in lines)  # only process 0 reports
    assert model.exists()
    assert_nothing_left(slurm_cluster)


JAX_PS_SCRIPT = REPO / "tests" / "local" / "jax_ps_script.py"


def test_the_tensorflow_ps_script_on_jax_through_srun(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    """ps-per-node under KERAS_BACKEND=jax on 2 real nodes: the TensorFlow ps script unchanged, each
    example once per epoch (1,003 rows, a short last batch), the .keras file on the chief's node."""
    epochs, rows = 2, 1003
    run = slurm_cluster.head(
        ["srun", "-N2", "--ntasks-per-node=1", "--cpus-per-task=2", *LAUNCH, "--layout", "ps-per-node",
         str(JAX_PS_SCRIPT), str(tmp_path), str(epochs), str(rows)],
        env={"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}, cwd=tmp_path, timeout=TIMEOUT,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-5000:]
    lines = meaningful(text)
    results = [json.loads(line.split("] ", 1)[1]) for line in lines if line.startswith("[n1 chief:0] {")]
    assert results, "\n".join(lines[-40:])
    history = results[-1]["history"]
    assert history["id_count"] == [rows] * epochs, history
    assert history["id_idsum"] == [float(sum(i % 1000 for i in range(rows)))] * epochs, history
    assert (tmp_path / "model.keras").exists()
    assert_nothing_left(slurm_cluster)
