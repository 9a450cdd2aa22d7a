"""The padded last all-reduce step is one synchronous step over exactly the examples left
(issue 10 §2), checked numerically in ONE process: a MultiWorkerMirroredStrategy over two
logical CPU devices is two replicas fed by one input pipeline, so a replica whose batches
ran out gets the zero-weight padding batch while the other holds the last real examples:
the same code path as two workers (`AllReduceTrainer`, `_with_padding`), and the
multi-replica worker of a node with several GPUs.

Reference: single-process Keras ``train_on_batch`` over the same examples, same initial
weights, SGD without momentum. BatchNorm: per-replica batch statistics (Keras' default,
``synchronized=False``), so the trainable weights match only when one replica holds all of
a step's examples; the moving statistics read from the model (replica 0, worker 0: never
padded) match, and at the epoch end every replica takes replica 0's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_cluster import REPO, last_json_line

pytestmark = pytest.mark.local

SCRIPT = r'''
import json
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import keras_distrib


def make(batch_norm):
    keras.utils.set_random_seed(1)
    inp = keras.Input((5,))
    h = keras.layers.Dense(6, activation="tanh")(inp)
    if batch_norm:
        h = keras.layers.BatchNormalization(momentum=0.5)(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def compare(model, ref):
    """Each weight's largest difference to the reference, for the model and every replica's copy."""
    weights = {}
    for i, (got, want) in enumerate(zip(model.weights, ref.weights)):
        copies = strategy.experimental_local_results(got.value)
        weights[f"{i}:{got.path}"] = {
            "trainable": got.trainable,
            "diff": float(np.max(np.abs(got.numpy() - want.numpy()))),
            "copy_diffs": [float(np.max(np.abs(np.asarray(c) - want.numpy()))) for c in copies],
        }
    return weights


rng = np.random.default_rng(0)
x, y = rng.normal(size=(11, 5)).astype("float32"), rng.integers(0, 3, 11)
strategy = tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(["/cpu:0", "/cpu:1"])
# Global batch 8 = 4 per replica; one pipeline deals its batches to the replicas in turn.
# n=3: [0:3] | padding. n=6: [0:4] | [4:6]. n=11: [0:4] | [4:8], then [8:11] | padding.
SPLITS = {3: [(0, 3)], 6: [(0, 6)], 11: [(0, 8), (8, 11)]}
results = []
for batch_norm in (False, True):
    for n, steps in SPLITS.items():
        with strategy.scope():
            model = make(batch_norm)
        start = [v.numpy() for v in model.weights]
        hist = keras_distrib.fit(model, x[:n], y[:n], epochs=1, batch_size=8, shuffle=False, verbose=0,
                                 strategy=strategy, steps_per_execution=1)
        ref = make(batch_norm)
        ref.set_weights(start)
        ref_losses = [float(ref.train_on_batch(x[a:b], y[a:b])) for a, b in steps]
        weights = compare(model, ref)
        want_loss = sum(l * (b - a) for l, (a, b) in zip(ref_losses, steps)) / n
        results.append({"batch_norm": batch_norm, "n": n, "weights": weights,
                        "loss": hist.history["loss"][0], "want_loss": want_loss})
# steps_per_epoch over arrays: shards repeat, every batch full, no count and no padding
# (the full-batch path). The stream cycles through the 11 examples, 8 per step.
cycle = np.arange(3 * 8) % 11
with strategy.scope():
    model = make(False)
start = [v.numpy() for v in model.weights]
hist = keras_distrib.fit(model, x, y, epochs=1, batch_size=8, steps_per_epoch=3, shuffle=False, verbose=0,
                         strategy=strategy, steps_per_execution=2)
ref = make(False)
ref.set_weights(start)
ref_losses = [float(ref.train_on_batch(x[cycle[s:s + 8]], y[cycle[s:s + 8]])) for s in range(0, 24, 8)]
results.append({"batch_norm": False, "n": "repeat", "weights": compare(model, ref),
                "loss": hist.history["loss"][0], "want_loss": float(np.mean(ref_losses))})
# The same over a batched dataset of static batch size (drop_remainder=True): its batch of 4
# is the global batch, 2 examples per replica; repeated, the steps are x[0:4], x[4:8], x[0:4].
with strategy.scope():
    model = make(False)
start = [v.numpy() for v in model.weights]
batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True)
hist = keras_distrib.fit(model, batches, epochs=1, steps_per_epoch=3, shuffle=False, verbose=0,
                         strategy=strategy, steps_per_execution=2)
ref = make(False)
ref.set_weights(start)
ref_losses = [float(ref.train_on_batch(x[s:s + 4], y[s:s + 4])) for s in (0, 4, 0)]
results.append({"batch_norm": False, "n": "repeat_batched", "weights": compare(model, ref),
                "loss": hist.history["loss"][0], "want_loss": float(np.mean(ref_losses))})
print(json.dumps({"results": results}), flush=True)
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    script = tmp_path_factory.mktemp("padded") / "padded_step.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_DISTRIB_LAYOUT")}
    env.update(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])))
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json_line(proc.stdout)["results"]


def _case(results: list[dict], batch_norm: bool, n: int | str) -> dict:
    return next(r for r in results if r["batch_norm"] == batch_norm and r["n"] == n)


@pytest.mark.parametrize("n", [3, 6, 11, "repeat", "repeat_batched"])
def test_padded_and_uneven_steps_equal_one_synchronous_step(results: list[dict], n: int | str) -> None:
    """n="repeat"/"repeat_batched": steps_per_epoch=3 over arrays / static-size batches
    repeated (full batches, no count, no padding)."""
    case = _case(results, False, n)
    assert case["loss"] == pytest.approx(case["want_loss"], rel=1e-5)
    for name, w in case["weights"].items():
        assert w["diff"] < 1e-6 and max(w["copy_diffs"]) < 1e-6, (n, name, w)


def test_padded_step_with_batch_norm(results: list[dict]) -> None:
    """n=3: replica 0 holds the 3 examples, replica 1 only padding."""
    case = _case(results, True, 3)
    assert case["loss"] == pytest.approx(case["want_loss"], rel=1e-5)
    for name, w in case["weights"].items():
        # Trainable weights and the model's (replica 0's) moving statistics are exact.
        assert w["diff"] < 1e-6, (name, w)
        if w["trainable"]:
            assert max(w["copy_diffs"]) < 1e-6, (name, w)
