"""A job on one CPU (srun --cpus-per-task=1, taskset) must train, not deadlock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_utils import launcher_env

pytestmark = pytest.mark.local

SCRIPT = """
import numpy as np, keras, keras_distrib
from keras_distrib.trainers import build
strategy = keras_distrib.strategy()
def make():
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m
x = np.random.rand(203, 8).astype("float32"); y = (x[:, 0] > 0.5).astype("int32")
model = build(make, strategy)
keras_distrib.fit(model, x, y, epochs=2, batch_size=16, verbose=0)
print("TRAINED", int(keras_distrib.trainers.trainer_for(model).global_step.numpy()))
"""


def test_ps_job_pinned_to_one_cpu_trains(tmp_path: Path) -> None:
    # TensorFlow sizes its inter-op pool by the CPUs it may use; with one thread the ps
    # layouts deadlocked (no step in 300 s). The agent gives such children a second one.
    (tmp_path / "train.py").write_text(SCRIPT)
    one_cpu = min(os.sched_getaffinity(0))
    env = launcher_env()
    env.pop("TF_NUM_INTEROP_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--startup-timeout", "60", "train.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
        preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}),
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    # 2 workers: shards of 102 and 101 examples, 7 steps each, per epoch.
    assert "TRAINED 28" in proc.stdout, proc.stdout[-3000:]
