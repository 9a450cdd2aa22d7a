"""Asynchronous parameter-server trainer on a real in-machine cluster (2 ps, 2 workers).

One cluster is shared by the whole module: a process connects to one cluster only.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer_cluster import REPO, PsCluster

from keras_distrib.trainers import trainer_for

pytestmark = pytest.mark.local
HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None

sys.path.insert(0, str(REPO / "examples"))


@pytest.fixture(scope="module")
def cluster() -> Any:
    c = PsCluster(num_workers=2, num_ps=2).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def strategy(cluster: PsCluster) -> Any:
    return cluster.strategy()


@pytest.fixture(scope="module")
def digits() -> tuple[Any, Any, Any, Any]:
    from digits_distrib import load

    return load(0)


def mlp(lr: float = 0.003) -> Any:
    from digits_distrib import make_model

    return make_model(lr)


def build(strategy: Any, fn: Any = mlp) -> Any:
    from keras_distrib.trainers import placement

    return placement.build(fn, strategy)


def local_eval(model: Any, x: Any, y: Any) -> dict[str, float]:
    """Loss/accuracy computed on the chief (reads the ps variables), for exact checks."""
    p = np.asarray(model(x, training=False))
    loss = float(np.mean(-np.log(np.clip(p[np.arange(len(y)), y], 1e-7, 1.0))))
    return {"loss": loss, "accuracy": float(np.mean(p.argmax(-1) == y))}


def test_variables_balanced_by_size_not_round_robin(strategy: Any) -> None:
    from keras_distrib.trainers.placement import plan_placement, ps_loads

    model = build(strategy)
    sizes = [int(np.prod(v.shape)) for v in model.variables]
    devices = [v.value.device for v in model.variables]
    plan = plan_placement(sizes, 2)
    assert [f"/job:ps/replica:0/task:{p}/device:CPU:0" for p in plan] == devices
    loads = sorted(ps_loads(model.variables).values())
    assert len(loads) == 2 and loads[1] / loads[0] < 1.1, loads  # round-robin: 17024 vs 202
    kernels = [v.value.device for v in model.variables if v.path.endswith("kernel")]
    assert len(set(kernels)) == 2  # round-robin puts every kernel on ps0
    slots = {v.path: v.value.device for v in model.optimizer.variables}
    for v in model.trainable_variables:  # Adam slots sit with their variable
        name = v.path.replace("/", "_")
        assert any(dev == v.value.device for key, dev in slots.items() if name in key)


class Recorder:
    """Custom callback recording what fit() reports."""

    def __new__(cls) -> Any:
        import keras

        class _Recorder(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.epoch_logs: list[dict[str, float]] = []
                self.batches: list[int] = []
                self.began = self.ended = False

            def on_train_begin(self, logs: Any = None) -> None:
                self.began = True

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.batches.append(batch)
                assert "loss" in logs

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                self.epoch_logs.append(dict(logs))

            def on_train_end(self, logs: Any = None) -> None:
                self.ended = True

        return _Recorder()


def test_fit_callbacks_logs_and_exact_step(strategy: Any, digits: Any, tmp_path: Path) -> None:
    import keras

    import keras_distrib

    x_train, x_test, y_train, y_test = digits
    model = build(strategy)
    rec = Recorder()
    cbs = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_loss", save_best_only=True),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        rec,
    ]
    if HAVE_TENSORBOARD:  # tf.summary needs the tensorboard package (not a TF dependency)
        cbs.append(keras.callbacks.TensorBoard(str(tmp_path / "tb")))
    history = keras_distrib.fit(
        model, (x_train, y_train), epochs=3, batch_size=32, callbacks=cbs,
        validation_data=(x_test, y_test), steps_per_execution=10, verbose=0, strategy=strategy,
    )
    # Every example once per epoch; each worker batches its shard (719 + 718): 23 + 23 steps.
    steps = 2 * int(np.ceil(len(x_train) / 2 / 32))
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(history.history["loss"]) == 3
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert rec.began and rec.ended and len(rec.epoch_logs) == 3
    assert rec.epoch_logs[-1]["val_accuracy"] == history.history["val_accuracy"][-1]
    # Batch hooks at closure granularity: index of each closure's last step.
    epoch_ends = [i for i, b in enumerate(rec.batches) if b == steps - 1]
    assert len(epoch_ends) == 3 and rec.batches[: epoch_ends[0] + 1] == sorted(rec.batches[: epoch_ends[0] + 1])
    trainer = trainer_for(model)
    assert int(trainer.global_step.numpy()) == 3 * steps
    assert int(model.optimizer.iterations.numpy()) == 3 * steps  # synced at epoch end
    # Validation logs are exact: every test example evaluated once, matching a local pass.
    ref = local_eval(model, x_test, y_test)
    assert history.history["val_accuracy"][-1] == pytest.approx(ref["accuracy"], abs=1e-6)
    assert history.history["val_loss"][-1] == pytest.approx(ref["loss"], rel=1e-4)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2] and "val_accuracy" in rows[0]
    if HAVE_TENSORBOARD:
        assert any(p.name.startswith("events") for p in (tmp_path / "tb").rglob("*"))
    assert (tmp_path / "best.keras").exists()


def test_packed_steps_keep_regularizers_and_layer_state(strategy: Any, digits: Any) -> None:
    """Steps run on packed variable values in a StatelessScope (trainers/packing.py):
    regularisation losses must still be in the loss, and BatchNorm statistics and dropout
    seeds updated in the scope must reach the ps variables."""
    import keras

    import keras_distrib

    x_train, _, y_train, _ = digits

    def regularised() -> Any:
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(1.0))])
        m.compile(optimizer=keras.optimizers.SGD(0.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    model = build(strategy, regularised)
    reg = float(sum(np.asarray(loss) for loss in model.losses))
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y_train, model(x_train)).numpy()
    history = keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=64, steps_per_epoch=20,
                                verbose=0, strategy=strategy)
    assert reg > 1.0  # the weights do not move (lr 0): the loss is cross-entropy + reg
    assert history.history["loss"][0] == pytest.approx(reg + ce, abs=0.2), (reg, ce)

    def stateful() -> Any:
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(10)])
        m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    model = build(strategy, stateful)
    seed = next(v for v in model.non_trainable_variables if "seed_generator_state" in v.path)
    seed_before = np.asarray(seed).copy()
    keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=64, steps_per_epoch=20, verbose=0,
                      strategy=strategy)
    assert np.abs(np.asarray(model.layers[1].moving_mean)).max() > 0.01  # starts at 0
    assert not np.array_equal(np.asarray(seed), seed_before)  # a new dropout mask per step


def counting() -> Any:
    """A model whose first layer adds 1 to a float variable at every training step."""
    import keras

    class StepCounter(keras.layers.Layer):
        def build(self, input_shape: Any) -> None:
            self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")

        def call(self, x: Any, training: bool | None = None) -> Any:
            if training:
                self.seen.assign(self.seen + 1.0)
            return x

    m = keras.Sequential([keras.Input((64,)), StepCounter(), keras.layers.Dense(10)])
    m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


@pytest.mark.parametrize("mode", ["default", "ps_stale_reads", "ps_local_steps"])
def test_steps_per_epoch_runs_exactly_that_many_unguarded_steps(strategy: Any, digits: Any, mode: str) -> None:
    """With steps_per_epoch the shards repeat and none is empty, so the steps run without
    a guard per step (`PerWorkerInput.endless`): still exactly 13 steps per epoch in chunks
    of 5, each counted once by the step counter, a layer and ``optimizer.iterations``. An
    input with an empty shard (1 example, 2 workers) keeps the guards and does not fail."""
    import keras_distrib
    from keras_distrib import data as kd
    from keras_distrib.trainers.ps.handout import PerWorkerInput

    x_train, _, y_train, _ = digits
    options = {} if mode == "default" else {mode: True}
    model = build(strategy, counting)
    keras_distrib.fit(model, (x_train, y_train), epochs=2, batch_size=16, steps_per_epoch=13, steps_per_execution=5,
                      verbose=0, strategy=strategy, **options)
    trainer = trainer_for(model)
    assert int(trainer.global_step.numpy()) == 26
    assert int(model.optimizer.iterations.numpy()) == 26
    assert float(np.asarray(model.layers[0].seen)) == 26
    endless = PerWorkerInput(trainer.coordinator, kd.as_source((x_train, y_train)), batch_size=16, shuffle=False,
                             seed=None, repeat=True)
    one = PerWorkerInput(trainer.coordinator, kd.as_source((x_train[:1], y_train[:1])), batch_size=16, shuffle=False,
                         seed=None, repeat=True)
    assert endless.endless and not one.endless
    keras_distrib.fit(model, (x_train[:1], y_train[:1]), epochs=1, batch_size=16, steps_per_epoch=3, verbose=0,
                      strategy=strategy, **options)
    assert 26 <= int(trainer.global_step.numpy()) <= 29  # closures on the empty shard run no step


def test_no_layer_state_update_is_lost_between_workers(strategy: Any, digits: Any) -> None:
    """Both workers update the same non-trainable state at once (as BatchNorm's statistics):
    a float counter that every training step adds 1 to must end at exactly the number of
    steps. Assigning each step's new value (read-modify-write on the ps) lost about half
    of them with 2 workers."""
    import keras_distrib

    x_train, _, y_train, _ = digits
    model = build(strategy, counting)
    keras_distrib.fit(model, (x_train, y_train), epochs=2, batch_size=16, verbose=0, strategy=strategy)
    steps = int(trainer_for(model).global_step.numpy())
    assert steps >= 2 * (len(x_train) // 16)  # two epochs of both shards
    assert float(np.asarray(model.layers[0].seen)) == steps


def stateful_mlp() -> Any:
    """The digits MLP with BatchNorm and a seeded Dropout: state on the ps besides the weights."""
    import keras

    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dropout(0.2, seed=1),
                          keras.layers.Dense(10, activation="softmax")])
    m.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def fit_stateful(strategy: Any, digits: Any, min_accuracy: float = 0.85, **option: bool) -> tuple[Any, Any, int]:
    """A `stateful_mlp` fitted 3 epochs with the step ``option`` over uneven shards (23 steps
    each, chunks of 10: partial and empty closures), checking what every step option keeps:
    exact epochs and step counter, BatchNorm statistics and dropout seeds carried to the ps,
    and that it learns. Returns (model, trainer, steps per epoch)."""
    import keras_distrib

    x_train, x_test, y_train, y_test = digits
    model = build(strategy, stateful_mlp)
    seed = next(v for v in model.non_trainable_variables if "seed_generator_state" in v.path)
    seed_before = np.asarray(seed).copy()
    history = keras_distrib.fit(model, (x_train, y_train), epochs=3, batch_size=32, steps_per_execution=10,
                                verbose=0, strategy=strategy, **option)
    steps = 2 * int(np.ceil(len(x_train) / 2 / 32))
    trainer = trainer_for(model)
    assert int(trainer.global_step.numpy()) == 3 * steps
    assert int(model.optimizer.iterations.numpy()) == 3 * steps
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert np.abs(np.asarray(model.layers[1].moving_mean)).max() > 0.01  # starts at 0
    assert not np.array_equal(np.asarray(seed), seed_before)
    accuracy = local_eval(model, x_test, y_test)["accuracy"]
    variance = np.asarray(model.layers[1].moving_variance)
    # Seen once under load with stale reads (0.125, not reproduced since): the
    # state that decides it is in the message.
    assert accuracy > min_accuracy, (accuracy, history.history, float(variance.min()),
                                     [bool(np.isfinite(np.asarray(w)).all()) for w in model.get_weights()])
    return model, trainer, steps


def test_stale_reads_option_keeps_exact_epochs_steps_and_layer_state(strategy: Any, digits: Any) -> None:
    """``ps_stale_reads=True`` (opt-in: one variable read per closure) keeps what
    `fit_stateful` checks; passing False again goes back to the default (re-traced) path."""
    import keras_distrib
    from keras_distrib.trainers.ps.modes import PsMode

    x_train, _, y_train, _ = digits
    # Its K gradients per closure are all taken at one read: how stale they are depends on the
    # machine's load (test accuracy 0.71 once beside the hang tests, above 0.85 when quieter).
    model, trainer, steps = fit_stateful(strategy, digits, min_accuracy=0.6, ps_stale_reads=True)
    assert trainer.mode is PsMode.STALE_READS
    keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=32, verbose=0, strategy=strategy,
                      ps_stale_reads=False)
    assert trainer.mode is PsMode.DEFAULT and int(trainer.global_step.numpy()) == 4 * steps


def test_local_steps_option_keeps_exact_epochs_steps_and_layer_state(strategy: Any, digits: Any) -> None:
    """``ps_local_steps=True`` (opt-in: K local steps per closure) with 2 workers keeps what
    `fit_stateful` checks and writes Adam's moments to the ps; switching to stale reads and
    back works."""
    import keras_distrib
    from keras_distrib.trainers.ps.modes import PsMode

    x_train, _, y_train, _ = digits
    model, trainer, steps = fit_stateful(strategy, digits, ps_local_steps=True)
    assert trainer.mode is PsMode.LOCAL_STEPS
    assert max(float(np.abs(np.asarray(v)).max()) for v in model.optimizer.variables[2:]) > 0  # moments moved
    keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=32, verbose=0, strategy=strategy,
                      ps_local_steps=False, ps_stale_reads=True)
    assert trainer.mode is PsMode.STALE_READS
    keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=32, verbose=0, strategy=strategy,
                      ps_local_steps=True, ps_stale_reads=False)
    assert trainer.mode is PsMode.LOCAL_STEPS and int(trainer.global_step.numpy()) == 5 * steps


def test_long_chunks_run_as_a_graph_loop(strategy: Any, digits: Any) -> None:
    """K above MAX_UNROLLED_STEPS takes the tf.range path; the remainder chunk is unrolled."""
    import keras_distrib
    from keras_distrib.trainers.ps import compiler

    x_train, _, y_train, _ = digits
    model = build(strategy)
    k = compiler.MAX_UNROLLED_STEPS + 8
    history = keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=32, steps_per_epoch=k + 5,
                                steps_per_execution=k, verbose=0, strategy=strategy)
    assert int(trainer_for(model).global_step.numpy()) == k + 5
    assert np.isfinite(history.history["loss"][0])


def test_arrays_are_counted_and_inputs_of_unknown_size_are_guarded(strategy: Any) -> None:
    """Which inputs take the closures' counted path (no guard per step): arrays, not a
    filtered tf.data, not a repeated input, never predict's."""
    import tensorflow as tf

    from keras_distrib import data as kd
    from keras_distrib.trainers.ps.handout import PerWorkerInput

    coord = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    ids = np.arange(101, dtype=np.int64)
    arrays = kd.as_source((ids, ids))
    filtered = kd.as_source(tf.data.Dataset.from_tensor_slices((ids, ids)).filter(lambda a, b: a % 2 == 0))

    def counted(source: Any, **options: Any) -> bool:
        options = {"countdown": True, "repeat": False, **options}
        return PerWorkerInput(coord, source, batch_size=10, shuffle=False, seed=None, **options).counted

    assert counted(arrays)
    assert not counted(filtered)
    assert not counted(arrays, repeat=True)
    assert not counted(arrays, countdown=False)


def test_arrays_are_handed_out_dynamically_and_other_inputs_keep_fixed_shards(strategy: Any) -> None:
    """Which inputs a fit hands out in parts to whichever worker is free (issue 28):
    unbatched arrays in tuples and dicts, without steps_per_epoch, unless turned off."""
    import keras
    import tensorflow as tf

    from keras_distrib import data as kd
    from keras_distrib.trainers.ps import ParameterServerTrainer
    from keras_distrib.trainers.ps.handout import DynamicDatasetInput, DynamicInput, PerWorkerInput

    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    trainer = ParameterServerTrainer(model, strategy)
    ids = np.arange(101, dtype=np.float32)

    def kind(data: Any, **options: Any) -> type:
        options = {"batch_size": 10, "shuffle": True, "seed": 0, "repeat": False, **options}
        return type(trainer._input(kd.as_source(data), **options))

    assert kind((ids, ids)) is DynamicInput
    assert kind(({"a": ids, "b": ids}, ids)) is DynamicInput
    assert kind((ids, ids), repeat=True) is PerWorkerInput  # steps_per_epoch: repeated shards
    assert kind((ids, ids), countdown=False) is PerWorkerInput  # predict keeps keyed shards
    assert kind(tf.data.Dataset.from_tensor_slices((ids, ids))) is DynamicDatasetInput
    assert kind(tf.data.Dataset.from_tensor_slices((ids, ids)).batch(7)) is DynamicDatasetInput
    assert kind(tf.data.Dataset.from_tensor_slices((ids, ids)).filter(lambda a, b: a > 3)) is PerWorkerInput  # size unknown
    def rows() -> Any:
        yield from zip(ids, ids)

    generated = tf.data.Dataset.from_generator(rows, output_signature=(tf.TensorSpec([], tf.float32),) * 2)
    assert kind(generated.apply(tf.data.experimental.assert_cardinality(101))) is PerWorkerInput  # Python on the chief
    py = tf.data.Dataset.from_tensor_slices((ids, ids)).map(lambda a, b: (tf.py_function(abs, [a], tf.float32), b))
    assert kind(py) is PerWorkerInput
    sparse = tf.data.Dataset.from_tensor_slices((ids, ids)).map(lambda a, b: (tf.sparse.from_dense([a]), b))
    assert kind(sparse) is PerWorkerInput  # rows of a sparse batch are not cut here
    assert kind(kd.ArraySource((ids.reshape(-1, 1), ids.reshape(-1, 1)), batched=True)) is PerWorkerInput
    inp = trainer._input(kd.as_source((ids, ids)), batch_size=10, shuffle=False, seed=None, repeat=False)
    assert inp.steps == 11  # shards of 51 and 50 rows: 6 + 5 steps, as with fixed shards
    with pytest.MonkeyPatch.context() as patch:  # too big to send each worker whole
        patch.setattr("keras_distrib.trainers.ps.handout.MAX_DYNAMIC_BYTES", ids.nbytes)
        assert kind((ids, ids)) is PerWorkerInput
    trainer.dynamic_epochs = False
    assert kind((ids, ids)) is PerWorkerInput


def id_model() -> Any:
    """A model fed example ids (x = id / n, y = id) whose metrics count the examples and sum their
    ids: an example seen twice or missed in an epoch changes one of them."""
    import keras
    from id_metrics import Count, IdSum

    m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mae", metrics=[Count(), IdSum()])  # bounded gradients
    return m


def write_ids(path: Path, first: int, size: int) -> None:
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as w:
        for i in range(first, first + size):
            w.write(tf.train.Example(features=tf.train.Features(feature={
                "id": tf.train.Feature(float_list=tf.train.FloatList(value=[i]))})).SerializeToString())


def id_files(tmp_path: Path, sizes: list[int], num_examples: int | None = None) -> Any:
    """A FileSource of ``len(sizes)`` TFRecord files of consecutive example ids (for `id_model`);
    ``num_examples``: the size it states (default: the true one)."""
    import tensorflow as tf

    from keras_distrib import data as kd

    n, paths = sum(sizes), []
    for j, size in enumerate(sizes):
        paths.append(tmp_path / f"ids-{j}.tfrecord")
        write_ids(paths[-1], sum(sizes[:j]), size)

    def parse_batch(records: Any) -> Any:
        v = tf.io.parse_example(records, {"id": tf.io.FixedLenFeature([1], tf.float32)})["id"]
        return v / n, v[:, 0]

    return kd.FileSource([str(p) for p in paths], parse_batch=parse_batch, num_examples=num_examples or n)


@pytest.mark.parametrize("kind", ["files", "files_underestimated", "files_small_shards", "arrays_fixed_shards"])
def test_shards_counted_once_then_closures_they_can_fill_run_unguarded(strategy: Any, tmp_path: Path, kind: str,
                                                                       monkeypatch: Any) -> None:
    """Files dealt to workers (sizes tf.data does not know, uneven: 132 and 421 examples)
    are counted in the first epoch; from then on the chief sends a closure unguarded when
    every shard can fill it (`shards_can_fill`), the shards' tails guarded. Arrays in fixed
    shards (tf.data knows their sizes) take the same path from the start. Shards within a
    window of closures of their ends (batch 8: 17 and 53 batches, K=4, 8 closures in flight)
    keep the guard. Every example once per epoch, in training and validation, and the step
    counter equals the steps run."""
    import keras_distrib
    from keras_distrib import data as kd
    from keras_distrib.trainers.ps import chief

    sizes = [50, 130, 17, 203, 1, 88, 64]  # file j to worker j % 2: 132 and 421 examples
    n = sum(sizes)
    ids = np.arange(n, dtype=np.float32)
    batch = 8 if kind == "files_small_shards" else 2
    if kind.startswith("files"):
        # A stated size below the files' is an estimate: the epoch is still every record once.
        data = id_files(tmp_path, sizes, n - 100 if kind == "files_underestimated" else n)
        shards = [132, 421]
    else:
        data = kd.ArraySource((ids.reshape(-1, 1) / n, ids))
        shards = [277, 276]
    model = build(strategy, id_model)
    trainer = trainer_for(model)
    trainer.dynamic_epochs = kind != "arrays_fixed_shards"  # arrays: the fixed shards, not the dynamic hand-out
    sure: list[bool] = []
    real = chief.shards_can_fill

    def spy(sizes: list[int], done: dict[int, int], in_flight: int, n: int) -> bool:
        if done or in_flight:  # a closure's, not the epoch run's look before it starts
            sure.append(real(sizes, done, in_flight, n))
            return sure[-1]
        return real(sizes, done, in_flight, n)

    monkeypatch.setattr(chief, "shards_can_fill", spy)  # the epoch's run looks it up in its module
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("keras_distrib.trainers.ps.handout").addHandler(handler)  # keras_distrib's loggers do not propagate
    import keras

    bar_steps: list[int] = []

    class BarSteps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            bar_steps.append(self.params["steps"])

    try:
        history = keras_distrib.fit(model, data, epochs=4, batch_size=batch, shuffle=True, validation_data=data,
                                    steps_per_execution=4, verbose=0, callbacks=[BarSteps()], strategy=strategy)
        h = history.history
        assert h["count"] == [n] * 4 and h["idsum"] == [n * (n - 1) / 2] * 4, h
        assert h["val_count"] == [n] * 4 and h["val_idsum"] == [n * (n - 1) / 2] * 4, h
        per_shard = [-(-size // batch) for size in shards]  # 66 + 211 (files), 139 + 138 (arrays)
        assert int(trainer.global_step.numpy()) == 4 * sum(per_shard)
        # The progress bar's steps: the estimate (num_examples: 227 for the underestimate), then
        # the steps counted in the first epoch.
        assert bar_steps[1:] == [sum(per_shard)] * 3, bar_steps
        assert (bar_steps[0] == sum(per_shard)) == (kind != "files_underestimated"), bar_steps
        counted = [m for m in said if "counted in the first: this epoch and the later ones run without a guard" in m]
        if kind == "files_small_shards":
            assert not sure and not counted
            return
        assert sure.count(True) > 0 and sure.count(False) > 0  # unguarded closures, then the shards' tails
        assert len(counted) == (2 if kind.startswith("files") else 0)  # training's and validation's, once each
        assert all(f"hold {per_shard} batches every epoch" in m for m in counted)
    finally:
        logging.getLogger("keras_distrib.trainers.ps.handout").removeHandler(handler)


def test_an_in_memory_cache_of_files_lasts_across_exact_epochs(strategy: Any, tmp_path: Path) -> None:
    """``FileSource(cache=True)`` without steps_per_epoch: each epoch's pipeline reads the
    shard made once for the fit, so the cache filled in the first epoch serves the later
    ones. Shown by deleting the files after the first epoch: the later epochs (training
    and validation) still see every example once."""
    import keras

    import keras_distrib
    from keras_distrib import data as kd

    sizes = [50, 130, 17, 203, 1, 88, 64]
    n = sum(sizes)
    files = id_files(tmp_path, sizes)
    data = kd.FileSource(files.files, parse_batch=files.parse_batch, num_examples=n, cache=True)

    class Delete(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:
                for path in data.files:
                    os.remove(path)

    model = build(strategy, id_model)
    history = keras_distrib.fit(model, data, epochs=3, batch_size=8, shuffle=True, validation_data=data,
                                steps_per_execution=4, verbose=0, callbacks=[Delete()], strategy=strategy)
    h = history.history
    assert h["count"] == [n] * 3 and h["idsum"] == [n * (n - 1) / 2] * 3, h
    assert h["val_count"] == [n] * 3 and h["val_idsum"] == [n * (n - 1) / 2] * 3, h


#: What the trainer logs when a worker was recovered in the counting epoch (its count is not taken).
RECOUNTED = "a worker read its shard again in the epoch that counts them"


@pytest.mark.parametrize("change", ["shorter", "longer"])
def test_files_changed_after_their_count_stop_the_fit_with_a_hint(strategy: Any, tmp_path: Path, change: str) -> None:
    """A file shortened or lengthened after the epoch that counted the shards: a later epoch
    ends in an error that says so, not a short or long epoch or TensorFlow's message; the
    cluster trains on. The count is taken from an epoch no worker was recovered in: when the
    coordinator recovered one (a loaded machine), the trainer says so and the fit runs again."""
    import keras

    import keras_distrib
    from keras_distrib.trainers import TrainerError

    sizes = [50, 130, 17, 203, 1, 88, 64]
    data = id_files(tmp_path, sizes)

    class Change(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 0:  # worker 0's shard: 132 -> 102 or 162 examples
                write_ids(Path(data.files[0]), 0, 20 if change == "shorter" else 80)

    said: list[str] = []
    handout = logging.getLogger("keras_distrib.trainers.ps.handout")  # the keras_distrib logger does not propagate
    listener = logging.Handler(logging.INFO)
    listener.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    handout.addHandler(listener)
    level, handout.level = handout.level, logging.INFO
    try:
        for attempt in range(3):
            write_ids(Path(data.files[0]), 0, sizes[0])
            said.clear()
            model = build(strategy, id_model)
            try:
                keras_distrib.fit(model, data, epochs=3, batch_size=2, steps_per_execution=4, verbose=0,
                                  callbacks=[Change()], strategy=strategy)
            except TrainerError as error:
                assert re.search(r"no longer hold the \[66, 211\] batches per worker counted in its first epoch "
                                 r".*HINT: keep the input's files unchanged", str(error)), error
                break
            assert any(RECOUNTED in line for line in said), f"attempt {attempt + 1}: the changed file went unnoticed"
        else:
            pytest.fail("a worker was recovered in the counting epoch of all 3 attempts")
    finally:
        handout.removeHandler(listener)
        handout.level = level
    # The HINT's alternative, in the same cluster: steps_per_epoch= trains on files that change
    # every epoch, its step counter exactly epochs x steps.
    class ChangeEvery(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            write_ids(Path(data.files[0]), 0, 10 + 40 * epoch)

    model = build(strategy, id_model)
    history = keras_distrib.fit(model, data, epochs=3, steps_per_epoch=25, batch_size=2, steps_per_execution=4,
                                verbose=0, callbacks=[ChangeEvery()], strategy=strategy)
    assert history.history["count"] == [50, 50, 50]  # 25 steps of batch 2
    assert int(model.optimizer.iterations.numpy()) == 75


@pytest.mark.parametrize("workers", [2, 3])
def test_a_tf_data_stream_holds_the_batches_of_the_fixed_shards(strategy: Any, workers: int) -> None:
    """`DynamicDatasetInput`'s numbered stream (what every worker reads) is, batch for batch,
    the fixed shards' batches (their union, each once), in every epoch of a reshuffled
    dataset: sizes that do not divide, 2 and 3 shards, unbatched and batched."""
    import tensorflow as tf

    from keras_distrib import data as kd
    from keras_distrib.trainers import _private_apis
    from keras_distrib.trainers.ps.handout import DynamicDatasetInput
    from keras_distrib.trainers.ps.readers import EPOCH_RUNS, PAST_THE_END, batch_of_run

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    def rows(batch: Any) -> tuple[tuple[int, ...], ...]:
        columns = [np.asarray(leaf) for leaf in tf.nest.flatten(batch)]
        return tuple(tuple(int(v) for v in (c if c.ndim == 1 else c[:, 0])) for c in columns)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_private_apis, "coordinator_workers", lambda c: list(range(workers)))
        for n, batch, batched in [(1, 4, False), (7, 4, False), (101, 8, False), (449, 32, False), (64, 32, False),
                                  (31, 10, True)]:
            ids = np.arange(n, dtype=np.int64)
            ds = tf.data.Dataset.from_tensor_slices(({"a": ids, "b": ids * 2}, ids)).shuffle(n, seed=3)
            ds, size = (ds.batch(batch), None) if batched else (ds, batch)
            source = kd.as_source(ds)
            inp = DynamicDatasetInput(coordinator, source, batch_size=size, shuffle=False, seed=5)
            assert inp.per_run == workers and inp.stacked == batched
            runs = -(-inp.steps // inp.per_run)
            # One stream holds the fit's epochs (here 1 and 2), numbered from epoch * EPOCH_RUNS.
            whole = list(inp._concrete(tf.constant(1, tf.int64), tf.constant(2, tf.int64)).take(2 * runs + 2))
            past = whole[2 * runs:]  # then endless empty runs, numbered beyond every part
            assert [int(i) for i, _ in past] == [PAST_THE_END] * 2
            assert all(np.asarray(leaf).shape[0] == 0 for leaf in tf.nest.flatten(past[0][1]))
            for epoch in (1, 2):
                numbered = whole[(epoch - 1) * runs:epoch * runs]
                assert [int(i) for i, _ in numbered] == [epoch * EPOCH_RUNS + r for r in range(runs)]
                assert inp.first_batch(epoch, inp.per_run) // inp.per_run == epoch * EPOCH_RUNS + 1
                # A stacked run holds as many batches as its rows tell (the last may hold fewer).
                batches = [rows(batch_of_run(run, s, inp.per_run, inp.stacked)) for _, run in numbered
                           for s in range(len(run[0]) if inp.stacked else inp.per_run)]
                assert all(batches[:inp.steps]) and not any(b[0] for b in batches[inp.steps:])  # the last run's empty shards
                fixed = [rows(b) for s in range(workers) for b in kd.pipeline(
                    source, s, workers, batch_size=size, shuffle=False, seed=5, repeat=False, epoch=epoch)]
                assert sorted(batches[:inp.steps]) == sorted(fixed), (n, batch, epoch)
                assert sorted(v for b in fixed for v in b[-1]) == ids.tolist()
            # Parts are whole runs (K=10: 9 batches of 3 runs with 3 workers), smaller within
            # the last 2 x workers x K batches (kd.tail_part_limit); a resume that starts inside
            # a run first goes up to a run's end.
            size = 10 - 10 % inp.per_run
            parts = list(inp.parts(0, 0, inp.steps, 10))
            assert sum(n for n, _ in parts) == inp.steps and all(first % inp.per_run == 0 for _, first in parts)
            assert all(n == size for n, first in parts if inp.steps - first > 2 * workers * 10 + size)
            assert all(n <= size and (n % inp.per_run == 0 or first + n == inp.steps) for n, first in parts)
            if inp.per_run > 1 and inp.steps > size:
                resumed = list(inp.parts(0, 1, inp.steps - 1, 10))
                limit = kd.tail_part_limit(inp.steps - 1, 10, inp.per_run, inp.per_run)
                assert resumed[0] == (min(limit - 1, inp.steps - 1), 1) and inp.offset(1) == 1
                assert sum(n for n, _ in resumed) == inp.steps - 1 and all(first % inp.per_run == 0 for _, first in resumed[1:])


def test_parts_in_a_graph_loop_keep_every_example_once(strategy: Any) -> None:
    """A chunk whose steps add too many operations runs them in a graph loop (here: every chunk):
    a part's batches are still found by their place in it, for arrays (rows gathered by
    step) and for a tf.data stream (runs fetched by the loop), with sizes that do not
    divide; every example once per epoch, none twice."""
    import keras
    import tensorflow as tf

    import keras_distrib
    from keras_distrib.trainers.ps import compiler

    from id_metrics import Count, IdSum

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "UNROLL_OPERATIONS_BUDGET", 0)
        for n, inputs in ((301, "arrays"), (301, "tf.data"), (97, "tf.data"), (97, "batched tf.data")):
            with strategy.scope():
                model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
                model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                              metrics=[IdSum(), Count()])  # counts only
            ids = np.arange(n, dtype=np.float32)
            data = (ids, ids) if inputs == "arrays" else (tf.data.Dataset.from_tensor_slices((ids, ids)),)
            kw = {"batch_size": 10}
            if inputs == "batched tf.data":
                data, kw = (data[0].batch(10),), {}
            hist = keras_distrib.fit(model, *data, epochs=2, steps_per_execution=7, verbose=0, strategy=strategy, **kw)
            steps = (-(-n // 10) if kw == {} else sum(-(-(n // 2 + (1 if i < n % 2 else 0)) // 10) for i in range(2)))
            assert hist.history["idsum"] == [float(ids.sum())] * 2, (n, inputs, hist.history)
            assert hist.history["count"] == [float(n)] * 2, (n, inputs, hist.history)
            assert int(model.optimizer.iterations.numpy()) == 2 * steps, (n, inputs)


def test_a_part_its_stream_has_passed_reads_a_fresh_stream(strategy: Any) -> None:
    """Parts handed out last to first: each worker's stream soon passes the next part it
    gets (as when the coordinator re-runs a lost worker's closure elsewhere). Those parts
    read their runs from a fresh stream of the epoch; every epoch still counts each
    example once, and no step runs twice."""
    import keras
    import tensorflow as tf

    import keras_distrib
    from keras_distrib.trainers.ps.handout import DynamicDatasetInput

    from id_metrics import IdSum

    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=[IdSum()])  # counts only
    ids = np.arange(301, dtype=np.float32)
    forward = DynamicDatasetInput.parts
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DynamicDatasetInput, "parts", lambda self, *a: reversed(list(forward(self, *a))))
        hist = keras_distrib.fit(model, tf.data.Dataset.from_tensor_slices((ids, ids)), batch_size=10, epochs=3,
                                 steps_per_execution=2, verbose=0, strategy=strategy)
    assert hist.history["idsum"] == [float(ids.sum())] * 3
    assert int(model.optimizer.iterations.numpy()) == 93  # 16 + 15 steps an epoch, none twice


def test_disjoint_shards_every_example_once(cluster: PsCluster, strategy: Any) -> None:
    """Record the sample ids each closure saw: one shard per worker, none dropped (1001/2)."""
    import tensorflow as tf

    from keras_distrib import data as kd
    from keras_distrib.trainers.ps.handout import PerWorkerInput

    coord = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    ids = np.arange(1001, dtype=np.int64)
    inp = PerWorkerInput(coord, kd.as_source((ids, ids)), batch_size=10, shuffle=True, seed=1, repeat=False)
    iterator = inp.iterator(0)

    @tf.function
    def take(iterator: Any) -> Any:
        opt = iterator.get_next_as_optional()
        if opt.has_value():
            return opt.get_value()[0]
        return tf.zeros([0], tf.int64)

    # More closures than batches: whichever worker gets them, every shard is drained.
    rvs = [coord.schedule(take, args=(iterator,)) for _ in range(2 * 101 + 20)]
    coord.join()
    batches = [np.asarray(r.fetch()) for r in rvs]
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == ids.tolist()  # disjoint (no repeats) and complete
    residues = [set((b % 2).tolist()) for b in batches if len(b)]
    assert all(len(r) == 1 for r in residues)  # each batch from a single worker's shard
    per_shard = {0: [], 1: []}
    for b in batches:
        if len(b):
            per_shard[int(b[0] % 2)].append(len(b))
    # Shards of 501 and 500 examples: 50 full batches each, plus the short tail of shard 0.
    assert sorted(per_shard[0]) == [1] + [10] * 50 and per_shard[1] == [10] * 50


def test_evaluate_uneven_exact(strategy: Any, digits: Any) -> None:
    import keras_distrib

    x_train, _, y_train, _ = digits
    x, y = x_train[:1001], y_train[:1001]
    model = build(strategy)
    keras_distrib.fit(model, (x, y), epochs=1, batch_size=10, verbose=0, strategy=strategy)
    assert int(trainer_for(model).global_step.numpy()) == 101
    logs = keras_distrib.evaluate(model, (x, y), batch_size=7, strategy=strategy, return_dict=True)
    ref = local_eval(model, x, y)
    # Without return_dict, what Keras returns: [loss, accuracy] in metrics_names order.
    assert keras_distrib.evaluate(model, (x, y), batch_size=7, strategy=strategy) == pytest.approx(
        [logs["loss"], logs["accuracy"]], rel=1e-6)
    assert logs["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
    assert logs["loss"] == pytest.approx(ref["loss"], rel=1e-4)


def test_fit_on_an_eager_tf_data_dataset(strategy: Any, digits: Any) -> None:
    """A batched tf.data.Dataset made on the chief trains and evaluates on the workers."""
    import tensorflow as tf

    import keras_distrib

    x_train, x_test, y_train, y_test = digits
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(32)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(60)
    model = build(strategy)
    history = keras_distrib.fit(model, train, epochs=3, verbose=0, strategy=strategy)
    assert history.history["loss"][-1] < history.history["loss"][0]
    loss, accuracy = keras_distrib.evaluate(model, test, strategy=strategy)
    assert accuracy > 0.8 and loss < 1.0


def test_save_keras_loads_in_plain_process(strategy: Any, digits: Any, tmp_path: Path) -> None:
    import keras_distrib

    x_train, x_test, y_train, _ = digits
    model = build(strategy)
    keras_distrib.fit(model, (x_train, y_train), epochs=1, batch_size=32, verbose=0, strategy=strategy)
    path = tmp_path / "model.keras"
    model.save(str(path))
    np.save(tmp_path / "x.npy", x_test[:20])
    expected = np.asarray(model(x_test[:20], training=False))
    code = (
        "import sys, numpy as np, keras\n"
        "m = keras.saving.load_model(sys.argv[1])\n"
        "np.save(sys.argv[3], m.predict(np.load(sys.argv[2]), verbose=0))\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.npy"), str(tmp_path / "p.npy")],
                   check=True, env=env, timeout=120, capture_output=True)
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), expected, rtol=1e-5, atol=1e-6)


def test_resume_restores_weights_optimizer_and_step(strategy: Any, digits: Any, tmp_path: Path) -> None:
    import keras_distrib

    x_train, _, y_train, _ = digits
    ckpt = str(tmp_path / "ckpt")
    first = build(strategy)
    trained = keras_distrib.fit(first, (x_train, y_train), epochs=1, batch_size=32, verbose=0, strategy=strategy,
                                checkpoint_dir=ckpt).history
    weights = [np.asarray(v.value) for v in first.variables]
    slots = [np.asarray(v.value) for v in first.optimizer.variables]
    step = int(trainer_for(first).global_step.numpy())
    assert step == 46  # 23 batches of each worker's shard (719 / 718 examples)

    second = build(strategy)
    history = keras_distrib.fit(second, (x_train, y_train), epochs=1, batch_size=32, verbose=0, strategy=strategy, checkpoint_dir=ckpt)
    # Epoch 0 already done: nothing retrained (the weights and step below), and the History
    # holds its logs, kept with the checkpoint, as one uninterrupted fit would return.
    assert history.history == trained and history.epoch == [0]
    for a, b in zip(weights, second.variables):
        np.testing.assert_array_equal(a, np.asarray(b.value))
    for a, b in zip(slots, second.optimizer.variables):
        np.testing.assert_array_equal(a, np.asarray(b.value))
    assert int(trainer_for(second).global_step.numpy()) == step
    keras_distrib.fit(second, (x_train, y_train), epochs=2, batch_size=32, verbose=0, strategy=strategy, checkpoint_dir=ckpt)
    assert int(trainer_for(second).global_step.numpy()) == 2 * step
    assert int(second.optimizer.iterations.numpy()) == 2 * step


def test_converges_like_single_process(strategy: Any, digits: Any) -> None:
    """Async PS with 2 workers within 1 point of single-process accuracy (same epochs/batch).

    The digits test set has 360 examples, so one run's accuracy moves by about a point
    with the seed alone: compare the means over three seeds on each side.
    """
    import keras

    import keras_distrib

    x_train, x_test, y_train, y_test = digits
    epochs, batch, seeds = 15, 32, (0, 1, 2)
    single_accs, dist_accs = [], []
    for seed in seeds:
        keras.utils.set_random_seed(seed)
        single = mlp(1e-3)
        single.fit(x_train, y_train, epochs=epochs, batch_size=batch, verbose=0)
        single_accs.append(float(single.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]))
        keras.utils.set_random_seed(seed)
        model = build(strategy, lambda: mlp(1e-3))
        keras_distrib.fit(model, (x_train, y_train), epochs=epochs, batch_size=batch, verbose=0,
                          strategy=strategy, seed=seed)
        dist_accs.append(keras_distrib.evaluate(model, (x_test, y_test), strategy=strategy, return_dict=True)["accuracy"])
    single_acc, dist_acc = sum(single_accs) / len(seeds), sum(dist_accs) / len(seeds)
    print(json.dumps({"single": single_accs, "ps_async": dist_accs}))
    assert single_acc > 0.95
    assert dist_acc >= single_acc - 0.01, (single_accs, dist_accs)


def test_errors_outside_job_and_wrong_layout(strategy: Any, monkeypatch: Any, capsys: Any) -> None:
    import keras

    import keras_distrib
    from keras_distrib.trainers import AllReduceTrainer, TrainerError

    data = (np.zeros((4, 64), "float32"), np.zeros(4, "int32"))
    plain = mlp()  # no strategy scope, no TF_CONFIG: plain Keras model.fit, said in one line
    history = keras_distrib.fit(plain, *data, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert "keras_distrib: not inside a keras_distrib job" in capsys.readouterr().err  # a log line
    monkeypatch.setenv("KERAS_DISTRIB_LAYOUT", "allreduce")  # a job, but no strategy in scope
    with pytest.raises(TrainerError, match=r"HINT: .*python -m keras_distrib\.local --nodes 2 SCRIPT") as info:
        keras_distrib.fit(mlp(), data)
    assert "HINT:" in str(info.value)
    monkeypatch.delenv("KERAS_DISTRIB_LAYOUT")
    model = build(strategy)
    with pytest.raises(TrainerError, match="allreduce"):
        AllReduceTrainer(model, strategy)
    with strategy.scope():
        bad = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    bad.compile(keras.optimizers.SGD(), "mse")  # optimizer created outside the scope
    with pytest.raises(TrainerError, match="optimizer was created outside"):
        keras_distrib.fit(bad, (np.zeros((4, 64), "float32"), np.zeros((4, 10), "float32")), strategy=strategy)


def test_callback_contract_order_and_stop_at_a_chunk_boundary(strategy: Any, digits: Any) -> None:
    """Keras' order of hooks (batch begin before its end, on_test_* during validation) and
    model.stop_training honoured at the next scheduled-function boundary, not the epoch end."""
    import keras

    import keras_distrib

    x_train, x_test, y_train, y_test = digits

    class Order(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[str] = []

        def on_train_begin(self, logs: Any = None) -> None:
            self.events.append("train_begin")

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.events.append("epoch_begin")

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.events.append("batch_begin")

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.events.append("batch_end")

        def on_test_begin(self, logs: Any = None) -> None:
            self.events.append("test_begin")

        def on_test_end(self, logs: Any = None) -> None:
            self.events.append("test_end")

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.events.append("epoch_end")

        def on_train_end(self, logs: Any = None) -> None:
            self.events.append("train_end")

    order = Order()
    model = build(strategy)
    keras_distrib.fit(model, x_train, y_train, epochs=2, batch_size=32, validation_data=(x_test, y_test),
                      callbacks=[order], steps_per_execution=5, verbose=0, strategy=strategy)
    ev = order.events
    assert ev[:3] == ["train_begin", "epoch_begin", "batch_begin"] and ev[-1] == "train_end"
    assert ev.count("epoch_begin") == 2 and ev.count("test_begin") == ev.count("test_end") == 2
    first_end = ev.index("batch_end")
    assert "batch_begin" in ev[:first_end]  # announced before the work
    assert ev.index("test_begin") > max(i for i, e in enumerate(ev[: ev.index("epoch_end")]) if e == "batch_end")

    class StopAfterTwoChunks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch >= 9:
                self.model.stop_training = True

    model = build(strategy)
    history = keras_distrib.fit(model, x_train, y_train, epochs=3, batch_size=8, callbacks=[StopAfterTwoChunks()],
                                steps_per_execution=5, verbose=0, strategy=strategy)
    steps = int(trainer_for(model).global_step.numpy())
    assert len(history.history["loss"]) == 1
    # Stopped after the chunk that reached step 10; closures already in flight (at most
    # 4 per worker, 5 steps each) still finish: far fewer than the epoch's 180 steps.
    assert 10 <= steps <= 100, steps


def test_predict_grid_in_input_order(strategy: Any, tmp_path: Path) -> None:
    """keras_distrib.predict returns model(x) row for row in the input's order (tests/local/predict_grid.py)."""
    import predict_grid

    import keras_distrib

    model = build(strategy, predict_grid.make_model)
    predict_grid.check(predict_grid.run(model, keras_distrib.predict, str(tmp_path)))


def test_keras_loops_on_a_ps_model_name_the_keras_distrib_function(strategy: Any, digits: Any) -> None:
    """model.fit/evaluate/predict of a ps model: one TrainerError naming keras_distrib.<same>."""
    import keras_distrib
    from keras_distrib.trainers import TrainerError

    x_train, _, y_train, _ = digits
    x, y = x_train[:64], y_train[:64]
    built = build(strategy)  # keras_distrib's build()
    with strategy.scope():  # built by hand: guarded from its first keras_distrib call on
        by_hand = mlp()
    keras_distrib.evaluate(by_hand, (x, y), strategy=strategy)
    for model in (built, by_hand):
        for name, args in (("fit", (x, y)), ("evaluate", (x, y)), ("predict", (x,))):
            with pytest.raises(TrainerError, match=rf"model\.{name}\(\) cannot run .*HINT: call keras_distrib\.{name}\(model"):
                getattr(model, name)(*args, verbose=0)
    # The keras_distrib functions still work on the guarded model.
    assert keras_distrib.predict(built, x, batch_size=16).shape == (64, 10)


def test_resume_keeps_the_callbacks_best_values(strategy: Any, digits: Any, tmp_path: Path, capsys: Any) -> None:
    """ModelCheckpoint(save_best_only) and EarlyStopping continue from the saved best after a resume;
    the chief's per-epoch line shows each worker's steps/s and fit ends with one summary line."""
    import keras

    import keras_distrib

    x_train, _, y_train, _ = digits
    x, y = x_train[:400], y_train[:400]
    ckpt = str(tmp_path / "ckpt")

    def callbacks() -> list[Any]:
        return [keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="loss", save_best_only=True),
                keras.callbacks.EarlyStopping(monitor="loss", patience=50)]

    first = callbacks()
    keras_distrib.fit(build(strategy), (x, y), epochs=2, batch_size=32, verbose=0, strategy=strategy,
                      callbacks=first, checkpoint_dir=ckpt)
    assert first[0].best is not None and first[1].best is not None

    class SeenAtResume(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if not hasattr(self, "seen"):
                self.seen = (epoch, second[0].best, second[1].best, second[1].wait)

    second = callbacks()
    probe = SeenAtResume()
    capsys.readouterr()
    keras_distrib.fit(build(strategy), (x, y), epochs=3, batch_size=32, verbose=2, strategy=strategy,
                      callbacks=second + [probe], checkpoint_dir=ckpt)
    assert probe.seen == (2, pytest.approx(first[0].best), pytest.approx(first[1].best), first[1].wait)
    err = capsys.readouterr().err
    assert re.search(r"keras_distrib: epoch 3/3: [\d.]+ s, [\d.]+ steps/s \(worker 0: [\d.]+, worker 1: [\d.]+ steps/s\)", err), err
    assert "keras_distrib: fit finished: trained epoch 3 (14 steps) in " in err and f"checkpoints in {ckpt}." in err, err


def test_csv_logger_continues_across_reruns_in_the_same_directory(strategy: Any, digits: Any, tmp_path: Path) -> None:
    """A rerun that resumes appends to CSVLogger's file (one header, one row per epoch), a
    rerun with nothing left keeps it, and a fit without a checkpoint starts it over (Keras)."""
    import keras

    import keras_distrib

    x_train, _, y_train, _ = digits
    x, y = x_train[:300], y_train[:300]
    log, ckpt = tmp_path / "log.csv", str(tmp_path / "ckpt")

    def run(epochs: int, checkpoint_dir: str | None = ckpt) -> None:
        keras_distrib.fit(build(strategy), (x, y), epochs=epochs, batch_size=32, verbose=0, strategy=strategy,
                          callbacks=[keras.callbacks.CSVLogger(str(log))], checkpoint_dir=checkpoint_dir)

    def epochs_logged() -> list[str]:
        with open(log, newline="") as fh:
            rows = list(csv.reader(fh))
        assert rows[0][:2] == ["epoch", "accuracy"], rows
        return [row[0] for row in rows[1:]]

    run(2)
    assert epochs_logged() == ["0", "1"]
    run(3)  # the rerun resumes at epoch 2: it appends
    assert epochs_logged() == ["0", "1", "2"]
    before = log.read_bytes()
    run(3)  # nothing left to train: the file stays as it is
    assert log.read_bytes() == before
    run(1, checkpoint_dir=None)  # no resume: Keras' rule, a new file
    assert epochs_logged() == ["0"]
