"""``ps_local_steps=True`` with ONE worker is plain sequential training: each closure runs
its K steps on a local copy of the weights, layer state and optimizer variables (Keras'
own optimizer math), then adds the change to the ps. So after an epoch the ps must hold
what single-process ``train_on_batch`` over the same batches gives, from the same initial
weights: weights, BatchNorm statistics, dropout seeds, Adam's moments and the step.

Run in a subprocess with its own cluster (chief + 1 ps + 1 worker): a process connects
to one cluster only, and the shared test clusters have 2 workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer_cluster import REPO, last_json_line

pytestmark = pytest.mark.local

SCRIPT = r'''
import json, os, sys, traceback
import numpy as np
sys.path.insert(0, sys.argv[1])
from trainer_cluster import PsCluster

cluster = PsCluster(num_workers=1, num_ps=1).start()
code = 1
try:
    strategy = cluster.strategy()
    import keras
    import keras_distrib
    from keras_distrib.trainers import TrainerError, trainer_for

    def make(optimizer):
        keras.utils.set_random_seed(3)
        inp = keras.Input((5,))
        h = keras.layers.Dense(7, activation="tanh")(inp)
        h = keras.layers.BatchNormalization(momentum=0.8)(h)
        h = keras.layers.Dropout(0.3, seed=5)(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(45, 5)).astype("float32"), rng.integers(0, 3, 45)
    batches = [(a, min(a + 8, 45)) for a in range(0, 45, 8)]  # 6 steps, the last of 5 examples
    optimizers = {
        "adam_schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.5)),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.02, weight_decay=0.1, clipnorm=0.5),
    }
    results = []
    for name, optimizer in optimizers.items():
        with strategy.scope():
            model = make(optimizer)
        start = [np.asarray(v).copy() for v in model.weights]  # set_weights: no seed state
        # K=4: a closure of 4 steps, one of 2 (its shard runs out), then empty ones.
        keras_distrib.fit(model, x, y, epochs=2, batch_size=8, shuffle=False, verbose=0, strategy=strategy,
                          steps_per_execution=4, ps_local_steps=True)
        ref = make(optimizer)
        ref.set_weights(start)
        for _ in range(2):
            for a, b in batches:
                ref.train_on_batch(x[a:b], y[a:b])
        pairs = list(zip(model.variables, ref.variables)) + list(zip(model.optimizer.variables, ref.optimizer.variables))
        diffs = {f"{got.path}": float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
                 for got, want in pairs}
        results.append({"optimizer": name, "diffs": diffs, "step": int(trainer_for(model).global_step.numpy()),
                        "iterations": int(model.optimizer.iterations.numpy())})
    errors = {}
    for name, optimizer in {"nadam": lambda: keras.optimizers.Nadam(),
                            "accumulation": lambda: keras.optimizers.SGD(gradient_accumulation_steps=2)}.items():
        with strategy.scope():
            model = make(optimizer)
        try:
            keras_distrib.fit(model, x, y, epochs=1, verbose=0, strategy=strategy, ps_local_steps=True)
        except TrainerError as exc:
            errors[name] = str(exc)
    try:
        keras_distrib.fit(model, x, y, epochs=1, verbose=0, strategy=strategy, ps_local_steps=True,
                          ps_stale_reads=True)
    except TrainerError as exc:
        errors["both"] = str(exc)
    print(json.dumps({"results": results, "errors": errors}), flush=True)
    code = 0
except BaseException:
    traceback.print_exc()
finally:
    cluster.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # TensorFlow's teardown with a remote context that is gone can hang
'''


@pytest.fixture(scope="module")
def outcome() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO / "tests" / "local")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return last_json_line(proc.stdout)


def test_one_worker_local_steps_equal_sequential_training(outcome: dict) -> None:
    """Weights, BatchNorm statistics, dropout seed, optimizer variables and the step after
    2 epochs of 6 uneven steps in closures of 4: as single-process train_on_batch."""
    assert len(outcome["results"]) == 3
    for r in outcome["results"]:
        assert r["step"] == 12 and r["iterations"] == 12, r
        assert any("moving_mean" in path for path in r["diffs"]) and any("seed" in path for path in r["diffs"])
        worst = max(r["diffs"].items(), key=lambda item: item[1])
        assert worst[1] < 2e-5, (r["optimizer"], worst)


def test_unsupported_optimizers_and_both_modes_fail_with_a_hint(outcome: dict) -> None:
    errors = outcome["errors"]
    assert "Nadam" in errors["nadam"] and "HINT" in errors["nadam"]
    assert "gradient_accumulation_steps" in errors["accumulation"] and "HINT" in errors["accumulation"]
    assert "cannot both be on" in errors["both"] and "HINT" in errors["both"]
