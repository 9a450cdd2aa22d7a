"""The jax layouts in local mode: Keras 3 on JAX (CPU, gloo) with plain model.fit, 2 and 3 processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from docs_blocks import docs_block
from launcher_utils import REPO, alive, listening_ports, meaningful, processes_with_env, start_local, wait_for

pytest.importorskip("jax", reason="the [jax] extra is not installed")

pytestmark = pytest.mark.local

# Every process imports TensorFlow and JAX: generous bounds for a loaded 2-core machine.
RUN_TIMEOUT = 600
JAX_ENV = {"JAX_PLATFORMS": "cpu"}


def run_local(tmp_path: Path, args: list[str], **env: str) -> tuple[int, list[str], int]:
    proc = start_local(args, tmp_path, **JAX_ENV, **env)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, meaningful(out), proc.pid


@pytest.mark.parametrize("nodes", [3])
def test_docs_jax_snippet_runs_as_written(tmp_path: Path, nodes: int) -> None:
    """1400 training examples, global batch 64: 22 batches, the last of 56; with 3 processes
    64 does not divide (63 kept) and bare Keras' shards would differ by a batch (2 processes:
    test_converges_like_single_process, the same layout on digits_jax.py)."""
    (tmp_path / "train.py").write_text(docs_block("jax-train"))  # docs/jax.md
    port_base = 28000 + (os.getpid() % 90) * 20  # known ports, to check none stays open
    code, lines, _ = run_local(tmp_path, ["--nodes", str(nodes), "--layout", "jax", "--port-base", str(port_base), "train.py"])
    assert code == 0, "\n".join(lines[-60:])
    accuracy = [line for line in lines if line.startswith("[local0 worker:0] val_accuracy")]
    assert accuracy and float(accuracy[0].split()[-1]) > 0.8, "\n".join(lines[-40:])
    others = [f"[local{i} worker:{i}] val_accuracy" for i in range(1, nodes)]
    assert not [line for line in lines if line.startswith(tuple(others))]
    assert (tmp_path / "model.keras").exists() and (tmp_path / "best.keras").exists()
    assert len((tmp_path / "log.csv").read_text().strip().splitlines()) == 1 + 5  # header + 5 epochs, once
    if nodes == 3:
        assert any("the global batch 64 does not divide by the 3 devices" in line for line in lines)
    assert not listening_ports() & set(range(port_base, port_base + nodes + 2)), "a job port is still open"


def test_converges_like_single_process(tmp_path: Path) -> None:
    """digits_jax.py on 2 processes vs plain single-process JAX: within 1 point (same global batch)."""
    script = str(REPO / "examples" / "digits_jax.py")
    args = ["--epochs", "8", "--json", "--verbose", "0"]
    code, lines, _ = run_local(tmp_path, ["--nodes", "2", "--layout", "jax", script, *args])
    assert code == 0, "\n".join(lines[-40:])
    distributed = json.loads(next(line.split("] ", 1)[1] for line in lines if line.startswith("[local0 worker:0] {")))
    import subprocess
    import sys

    from launcher_utils import launcher_env

    single = subprocess.run([sys.executable, script, "--single-process", *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=RUN_TIMEOUT, env=launcher_env(KERAS_BACKEND="jax", **JAX_ENV))
    assert single.returncode == 0, single.stderr[-3000:]
    baseline = json.loads(single.stdout.strip().splitlines()[-1])
    assert baseline["test_accuracy"] > 0.9
    assert abs(distributed["test_accuracy"] - baseline["test_accuracy"]) <= 0.01, (distributed, baseline)


def test_check_runs_a_cross_process_sum(tmp_path: Path) -> None:
    code, lines, _ = run_local(tmp_path, ["--nodes", "2", "--layout", "jax", "--check"])
    assert code == 0, "\n".join(lines[-40:])
    text = "\n".join(lines)
    assert "cross-process sum over 2 device(s) of 2 process(es): 3 (expected 3)" in text, text[-3000:]
    rows = [line for line in lines if line.startswith("[local0 worker:0] local") and line.endswith("OK")]
    assert len(rows) == 2, text[-3000:]
    assert "[local0 worker:0] 2 OK, 0 FAILED" in text


def test_killed_process_stops_the_job_with_one_line(tmp_path: Path) -> None:
    script = str(REPO / "examples" / "digits_jax.py")
    # --max-restarts 0: this is the fail-fast path (by default a death restarts the group).
    proc = start_local(["--nodes", "2", "--layout", "jax", "--max-restarts", "0", script, "--epochs", "500",
                        "--verbose", "2"], tmp_path, **JAX_ENV)
    try:
        # worker:1 has joined once its marker port listens; kill it during training.
        # This job's only (parent=): another test's jax job may run beside it (pytest-xdist).
        assert wait_for(lambda: bool(processes_with_env("KERAS_DISTRIBUTION_PROCESS_ID", "1", parent=proc.pid)),
                        RUN_TIMEOUT / 2)
        victims = processes_with_env("KERAS_DISTRIBUTION_PROCESS_ID", "1", parent=proc.pid)
        time.sleep(5)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    failures = [line for line in meaningful(out) if "exited unexpectedly" in line]
    assert failures == ["[local0 agent] keras_distrib: error: worker:1 on local1 exited unexpectedly with signal 9 "
                        "(SIGKILL); stopping the job."], out[-3000:]
    assert not alive(processes_with_env("KERAS_DISTRIBUTION_NUM_PROCESSES", "2", parent=proc.pid))


def test_sigterm_ends_the_job(tmp_path: Path) -> None:
    """The launcher forwards SIGTERM during training; every process ends, exit code 143."""
    script = str(REPO / "examples" / "digits_jax.py")
    proc = start_local(["--nodes", "2", "--layout", "jax", script, "--epochs", "500", "--verbose", "2"], tmp_path,
                       **JAX_ENV)
    try:
        assert wait_for(lambda: len(processes_with_env("KERAS_DISTRIBUTION_NUM_PROCESSES", "2", parent=proc.pid)) == 2,
                        RUN_TIMEOUT / 2)
        time.sleep(20)  # into training
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "got SIGTERM; forwarded" in out
    assert not alive(processes_with_env("KERAS_DISTRIBUTION_NUM_PROCESSES", "2", parent=proc.pid))


def test_a_process_that_never_joins_is_named(tmp_path: Path) -> None:
    (tmp_path / "late.py").write_text(
        "import os, time\n"
        "import keras_distrib\n"
        "if os.environ['KERAS_DISTRIBUTION_PROCESS_ID'] == '1':\n"
        "    time.sleep(3600)\n"
        "keras_distrib.distribution()\n"
    )
    code, lines, _ = run_local(tmp_path, ["--nodes", "2", "--layout", "jax", "--startup-timeout", "20", "late.py"])
    assert code == 1, "\n".join(lines[-30:])
    named = [line for line in lines if "never reached keras_distrib.distribution()" in line]
    assert len(named) == 1 and "(worker:1 on local1)" in named[0] and "(worker:0 on local0)" not in named[0], lines[-20:]


@pytest.mark.parametrize("examples", [1797, 65, 5, 1])
@pytest.mark.parametrize("batch", [64, 7])
@pytest.mark.parametrize("processes", [2, 3])
def test_even_shards_grid(examples: int, batch: int, processes: int) -> None:
    """Every process gets the same number of equal batches, disjoint, and only each batch's
    remainder past a multiple of the device count is left out (the examples are ids)."""
    import tensorflow as tf

    from keras_distrib.jax_distribution import shard_evenly

    data = tf.data.Dataset.range(examples).map(lambda i: (i, -i)).batch(batch)
    shards = [[(x.numpy().tolist(), y.numpy().tolist()) for x, y in shard_evenly(data, p, processes, processes, 1)]
              for p in range(processes)]
    assert len({len(s) for s in shards}) == 1  # the same step count everywhere: no collective waits alone
    for step in zip(*shards):
        assert len({len(x) for x, _ in step}) == 1 and len(step[0][0]) > 0
        assert all(y == [-v for v in x] for x, y in step)  # features and labels stay paired
    seen = [v for s in shards for x, _ in s for v in x]
    assert len(seen) == len(set(seen))
    expected = sum(size - size % processes for size in [batch] * (examples // batch) + [examples % batch] if size)
    assert len(seen) == expected


RESUMABLE = r'''
import json, os, sys
import numpy as np
import keras
import tensorflow as tf
import keras_distrib

keras_distrib.distribution()
info = keras_distrib.cluster()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int32")
train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=1).batch(32)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2, activation="softmax")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"])


class Crash(keras.callbacks.Callback):
    """Kills process 0 at the end of the second epoch, once (after the backup was written)."""
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and info.is_chief and not os.path.exists("crashed"):
            open("crashed", "w").close()
            os._exit(3)


history = model.fit(train, epochs=4, callbacks=[keras_distrib.backup_and_restore("backup"), Crash()], verbose=0)
if info.is_chief:
    print(json.dumps({"epochs": len(history.history["loss"]), "accuracy": history.history["accuracy"][-1]}), flush=True)
'''


def test_a_killed_job_resumes_from_its_backup(tmp_path: Path) -> None:
    """Issue 30: the jax layouts resume (keras_distrib.backup_and_restore): process 0 dies at
    the end of epoch 2 of 4; the same command again resumes at epoch 3 with the resume line."""
    (tmp_path / "train.py").write_text(RESUMABLE)
    code, lines, _ = run_local(tmp_path, ["--nodes", "2", "--layout", "jax", "train.py"])
    # 3 (process 0), or 1 when process 1's failed collective is reported first.
    assert code != 0 and (tmp_path / "crashed").exists(), "\n".join(lines[-40:])
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["epoch"] == 2
    code, lines, _ = run_local(tmp_path, ["--nodes", "2", "--layout", "jax", "train.py"])
    assert code == 0, "\n".join(lines[-40:])
    resumed = [line for line in lines if "resuming from backup (epoch 2 done)." in line]
    assert len(resumed) == 1 and resumed[0].startswith("[local0 worker:0]"), "\n".join(lines[-40:])
    result = json.loads(next(line.split("] ", 1)[1] for line in lines if line.startswith("[local0 worker:0] {")))
    assert result["epochs"] == 2 and result["accuracy"] > 0.8, result
    assert not (tmp_path / "backup").exists()  # deleted at the end of a completed fit, as Keras does
