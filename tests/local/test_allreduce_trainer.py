"""Synchronous all-reduce trainer: every worker runs a script (written below) with TF_CONFIG."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer_cluster import REPO, last_json_line, run_script_cluster

pytestmark = pytest.mark.local

WORKER_SCRIPT = r'''
import hashlib, json, os, sys
import numpy as np
sys.path.insert(0, os.path.join(os.environ["REPO"], "examples"))
import keras, tensorflow as tf
import keras_distrib
from digits_distrib import load, make_model
from keras_distrib.trainers import TrainerError, placement, trainer_for

mode, out = sys.argv[1], sys.argv[2]
strategy = keras_distrib.strategy()
rank = strategy.cluster_resolver.task_id
x_train, x_test, y_train, y_test = load(0)

def digest(model):
    h = hashlib.sha256()
    for v in model.variables + model.optimizer.variables:
        h.update(np.asarray(v.value).tobytes())
    return h.hexdigest()

class Weights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__(); self.digests = []
    def on_train_batch_end(self, batch, logs=None):
        self.digests.append(digest(self.model))

result = {"rank": rank}
if mode == "train":
    model = placement.build(make_model, strategy)
    rec = Weights()
    cbs = [rec, keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
           keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt.keras"))]
    hist = keras_distrib.fit(model, (x_train, y_train), epochs=2, batch_size=64, callbacks=cbs,
                             validation_data=(x_test, y_test), steps_per_execution=1, verbose=0,
                             strategy=strategy, checkpoint_dir=os.path.join(out, "tfckpt"))
    trainer = trainer_for(model, strategy)
    result.update(digests=rec.digests, history=hist.history, step=int(trainer.global_step.numpy()),
                  is_chief=trainer.is_chief, files=sorted(os.listdir(out)))
    if trainer.is_chief:
        model.save(os.path.join(out, "model.keras"))
        np.save(os.path.join(out, "pred.npy"), np.asarray(model(x_test[:20], training=False)))
    # Resume: a fresh model restores weights, optimizer state and step from the checkpoint.
    again = placement.build(make_model, strategy)
    h2 = keras_distrib.fit(again, (x_train, y_train), epochs=2, batch_size=64, verbose=0,
                           strategy=strategy, checkpoint_dir=os.path.join(out, "tfckpt"))
    result.update(resumed_history=h2.history, resumed_digest=digest(again), final_digest=digest(model),
                  resumed_step=int(trainer_for(again, strategy).global_step.numpy()))
elif mode == "uneven":
    x, y = x_train[:1001], y_train[:1001]
    model = placement.build(make_model, strategy)
    hist = keras_distrib.fit(model, (x, y), epochs=1, batch_size=30, verbose=0, strategy=strategy)
    logs = keras_distrib.evaluate(model, (x, y), batch_size=30, strategy=strategy, return_dict=True)
    p = np.asarray(model(x, training=False))
    result.update(step=int(trainer_for(model, strategy).global_step.numpy()), eval=logs,
                  local_accuracy=float(np.mean(p.argmax(-1) == y)),
                  local_loss=float(np.mean(-np.log(np.clip(p[np.arange(len(y)), y], 1e-7, 1)))))
    # BatchNorm statistics: each worker updates its own from its own batches; every epoch
    # end gives all of them worker 0's (what the chief saves), so evaluate == saved model.
    def bn_model():
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dense(10, activation="softmax")])
        m.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return m
    bn = placement.build(bn_model, strategy)
    keras_distrib.fit(bn, (x, y), epochs=1, batch_size=30, verbose=0, strategy=strategy)
    # Files dealt to workers, of uneven sizes tf.data does not know: the first epoch counts
    # each step's examples, the later ones run on those counts, every example once.
    import logging
    from keras_distrib import data as kd
    sizes, paths, first = [50, 130, 17, 203, 1, 88, 64], [], 0  # workers: 317, 131, 105 examples
    for j, size in enumerate(sizes):
        paths.append(os.path.join(out, f"ids-{j}.tfrecord"))
        with tf.io.TFRecordWriter(f"{paths[-1]}.{rank}") as w:  # privately, then renamed: no half-written file
            for i in range(first, first + size):
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(float_list=tf.train.FloatList(value=[i]))})).SerializeToString())
        os.replace(f"{paths[-1]}.{rank}", paths[-1])
        first += size
    n = sum(sizes)
    def parse_batch(records):
        v = tf.io.parse_example(records, {"id": tf.io.FixedLenFeature([1], tf.float32)})["id"]
        return v / n, v[:, 0]
    class Count(keras.metrics.Metric):
        def __init__(self, name="count", **kw):
            super().__init__(name=name, **kw)
            self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        def update_state(self, y_true, y_pred, sample_weight=None):
            self.total.assign_add(tf.reduce_sum(tf.cast(sample_weight if sample_weight is not None else tf.ones_like(y_true), self.total.dtype)))
        def result(self):
            return self.total + 0.0
    class IdSum(Count):
        def update_state(self, y_true, y_pred, sample_weight=None):
            w = sample_weight if sample_weight is not None else tf.ones_like(y_true)
            self.total.assign_add(tf.reduce_sum(tf.cast(y_true * w, self.total.dtype)))
    def id_model():
        m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mae", metrics=[Count(), IdSum(name="idsum")])
        return m
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("keras_distrib.trainers.allreduce_input").addHandler(handler)
    files = kd.FileSource(paths, parse_batch=parse_batch, num_examples=n)
    ids = placement.build(id_model, strategy)
    h = keras_distrib.fit(ids, files, epochs=3, batch_size=30, validation_data=files, verbose=0, strategy=strategy)
    result["files"] = {"history": h.history, "n": n, "step": int(trainer_for(ids, strategy).global_step.numpy()),
                       "said": list(said)}
    # cache=True: the second epoch (the first on the counts) fills a cache that serves the
    # later ones, shown by deleting the files (this worker's own copies) after it.
    import shutil
    mine = []
    for path in paths:
        mine.append(f"{path}.copy{rank}")
        shutil.copy(path, mine[-1])
    class Delete(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                for path in mine:
                    os.remove(path)
    cached = kd.FileSource(mine, parse_batch=parse_batch, num_examples=n, cache=True)
    h = keras_distrib.fit(placement.build(id_model, strategy), cached, epochs=4, batch_size=30, shuffle=True,
                          callbacks=[Delete()], verbose=0, strategy=strategy)
    result["files_cache"] = {"history": h.history, "n": n}
    result["bn_state"] = hashlib.sha256(b"".join(np.asarray(v.value).tobytes()
                                                 for v in bn.non_trainable_variables)).hexdigest()
    try:  # the parameter-server-only option is refused with a hint
        keras_distrib.fit(model, (x, y), epochs=1, verbose=0, strategy=strategy, ps_stale_reads=True)
    except TrainerError as exc:
        result["stale_reads_error"] = str(exc)
    # The predict grid (tests/local/predict_grid.py) in this same job: every worker gets all rows.
    sys.path.insert(0, os.path.join(os.environ["REPO"], "tests", "local"))
    import predict_grid
    grid_dir = os.path.join(out, f"predict-{rank}")
    os.makedirs(grid_dir, exist_ok=True)
    result["predict"] = predict_grid.run(placement.build(predict_grid.make_model, strategy), keras_distrib.predict, grid_dir)
print(json.dumps(result), flush=True)
'''


def run(tmp_path: Path, mode: str, workers: int) -> list[dict[str, Any]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    os.environ["REPO"] = str(REPO)
    procs = run_script_cluster(script, [mode, str(out)], num_workers=workers, layout="allreduce", timeout=240)
    for p in procs:
        assert p.returncode == 0, p.stderr[-4000:]
    return [last_json_line(p.stdout) for p in procs]


def test_sync_training_identical_weights_chief_writes_resume(tmp_path: Path) -> None:
    results = run(tmp_path, "train", 2)
    chief, other = sorted(results, key=lambda r: r["rank"])
    steps = int(np.ceil(1437 / 2 / 32))  # longest shard (719) in per-worker batches of 32
    assert len(chief["digests"]) == 2 * steps
    assert chief["digests"] == other["digests"]  # weights + optimizer identical after every step
    assert chief["step"] == other["step"] == 2 * steps
    assert chief["history"] == other["history"]  # logs are all-reduced
    assert chief["history"]["val_accuracy"][-1] > 0.85
    assert chief["is_chief"] and not other["is_chief"]
    out = tmp_path / "out"
    assert {"log.csv", "ckpt.keras", "tfckpt", "model.keras", "pred.npy"} <= set(os.listdir(out))
    assert len((out / "log.csv").read_text().strip().splitlines()) == 3  # header + 2 epochs, chief only
    # Resume: nothing left to train, state restored exactly.
    for r in results:
        assert r["resumed_history"] == {}
        assert r["resumed_step"] == 2 * steps
        assert r["resumed_digest"] == r["final_digest"]
    # The saved model loads in a plain single-process Keras session with identical predictions.
    sys.path.insert(0, str(REPO / "examples"))
    code = (
        "import sys, numpy as np, keras\n"
        "sys.path.insert(0, sys.argv[3])\n"
        "from digits_distrib import load\n"
        "m = keras.saving.load_model(sys.argv[1])\n"
        "np.save(sys.argv[2], m.predict(load(0)[1][:20], verbose=0))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, "-c", code, str(out / "model.keras"), str(tmp_path / "p.npy"), str(REPO / "examples")],
                   check=True, env=env, timeout=120, capture_output=True)
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), np.load(out / "pred.npy"), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def uneven_results(tmp_path_factory: Any) -> list[dict[str, Any]]:
    """One 3-worker job shared by the uneven-data and predict tests."""
    return run(tmp_path_factory.mktemp("uneven"), "uneven", 3)


def test_uneven_data_three_workers_no_hang_nothing_dropped(uneven_results: list[dict[str, Any]]) -> None:
    """1001 examples over 3 workers (334/334/333), 10 per worker per step."""
    results = uneven_results
    for r in results:
        assert r["step"] == 34  # ceil(334 / 10): the longest shard decides, nobody hangs
        # Every example evaluated exactly once: distributed metrics equal a local full pass.
        assert r["eval"]["accuracy"] == pytest.approx(r["local_accuracy"], abs=1e-6)
        assert r["eval"]["loss"] == pytest.approx(r["local_loss"], rel=1e-4)
        assert "ps_stale_reads=True needs a parameter-server layout" in r["stale_reads_error"]
        assert "HINT: drop ps_stale_reads" in r["stale_reads_error"]


def test_files_are_counted_in_the_first_epoch_then_every_step_runs_on_its_count(
        uneven_results: list[dict[str, Any]]) -> None:
    """A FileSource (7 files, 317/131/105 examples over 3 workers, 10 per worker per step):
    every example once in each of 3 epochs and validations (the padding rows carry weight 0,
    so the count is of real examples), 32 steps per epoch, and the step counts learned
    (training and validation) and announced once, when training's are first used."""
    for r in uneven_results:
        files = r["files"]
        n, h = files["n"], files["history"]
        assert h["count"] == [n] * 3 and h["val_count"] == [n] * 3, h
        assert h["idsum"] == [n * (n - 1) / 2] * 3 and h["val_idsum"] == [n * (n - 1) / 2] * 3, h
        assert files["step"] == 3 * 32
        learned = [m for m in files["said"] if "without counting" in m]
        assert learned == ["every epoch of this FileSource has 32 steps, counted in the first: this one and the "
                           "later ones run without counting each step's examples."], files["said"]


def test_an_in_memory_cache_of_files_lasts_across_the_epochs_on_the_counts(
        uneven_results: list[dict[str, Any]]) -> None:
    """``FileSource(cache=True)``: the epochs on the counts read one shard made for them, so
    its cache, filled in the second epoch, serves the third and fourth with the files gone."""
    for r in uneven_results:
        n, h = r["files_cache"]["n"], r["files_cache"]["history"]
        assert h["count"] == [n] * 4 and h["idsum"] == [n * (n - 1) / 2] * 4, h


def test_batchnorm_statistics_are_worker_zeros_on_every_worker(uneven_results: list[dict[str, Any]]) -> None:
    """After fit every worker holds worker 0's moving statistics (what the chief saves)."""
    assert len({r["bn_state"] for r in uneven_results}) == 1


def test_predict_grid_every_worker_gets_all_rows_in_order(uneven_results: list[dict[str, Any]]) -> None:
    """keras_distrib.predict on 3 all-reduce workers (the grid ran in the "uneven" job)."""
    import predict_grid

    assert len(uneven_results) == 3
    for r in uneven_results:
        predict_grid.check(r["predict"])
