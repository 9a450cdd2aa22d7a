"""Training workloads for the throughput benchmarks (ps_throughput, sync_throughput, input_stall).

The benchmark programs call `launch()`, which runs this file as the SCRIPT of
``python -m keras_distrib.local ...``: the parameter-server chief (or every all-reduce
worker) executes ``python bench/_train_jobs.py MODE --model M --sides A,B,...``, builds one
model per side, then alternates the sides for ``--rounds`` rounds *inside this one process
and cluster* (round i runs the sides in a rotated order, so drift hits all alike) and
writes ``{"sides": {side: [steps/s per round]}}`` as JSON to ``--result``.

Models: ``model_fn(keras)`` builds an uncompiled model with the Keras module it is given
(Keras 3 ``keras`` or ``tf_keras``), so every side trains the same architecture. It must
output logits of shape (batch, classes). Built in: ``mlp`` and ``cnn``; any other function
with that signature works: ``--model package.module:fn`` or ``--model path/file.py:fn``.
Every side compiles it with Adam(1e-3), sparse categorical cross-entropy (from logits)
and the accuracy metric.

Data: synthetic, seeded: ``--examples`` normal inputs of the model's input shape (integer
ids below the smallest Embedding's ``input_dim`` if the input is an integer) and uniform
labels, in memory; every side uses the same global batch (``--batch``): one
optimizer update consumes ``--batch`` examples (parameter server: per worker step;
all-reduce: split over the workers).

Timing: every side runs fit with steps_per_epoch=S for one untimed epoch and then
``--timed-epochs`` T timed ones (an epoch callback, or the hand loop's own clock), so
tracing, per-worker dataset creation and the first closures are excluded. steps/s =
T x S / (the T epochs' seconds). Process start-up and cluster connection are never timed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import child_env  # noqa: E402
from _jobs import free_port_base  # noqa: E402

LR = 1e-3
SHUFFLE_BUFFER = 10_000


# ---------------------------------------------------------------- models


def mlp(keras: Any) -> Any:
    """64 features -> 256 -> 256 -> 10 logits (about 85k parameters)."""
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])


def cnn(keras: Any) -> Any:
    """28x28x1 -> conv 16 -> pool -> conv 32 -> pool -> dense 64 -> 10 logits (about 56k parameters)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


MODELS: dict[str, Callable[[Any], Any]] = {"mlp": mlp, "cnn": cnn}


def load_model_fn(spec: str) -> Callable[[Any], Any]:
    """``mlp``, ``cnn``, ``package.module:fn`` or ``path/to/file.py:fn``."""
    if spec in MODELS:
        return MODELS[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise SystemExit(f"--model {spec!r}: use mlp, cnn, module:function or file.py:function")
    if where.endswith(".py"):
        path = Path(where).resolve()
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def model_name(spec: str) -> str:
    return spec if spec in MODELS else spec.rpartition(":")[2]


def compile_model(model: Any, keras: Any, **kwargs: Any) -> Any:
    model.compile(
        optimizer=keras.optimizers.Adam(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return model


def synthetic(model_fn: Callable[[Any], Any], examples: int, seed: int = 0) -> tuple[Any, Any]:
    """(x, y) NumPy arrays matching the Keras 3 build of ``model_fn``."""
    import keras
    import numpy as np

    probe = model_fn(keras)
    shape = tuple(probe.input_shape[1:])
    classes = int(probe.output_shape[-1])
    rng = np.random.default_rng(seed)
    dtype = str(probe.inputs[0].dtype)
    if "int" in dtype:  # token ids: valid for the smallest Embedding table (else 0/1)
        vocab = min([layer.input_dim for layer in probe._flatten_layers() if hasattr(layer, "input_dim")] or [2])
        x = rng.integers(0, vocab, size=(examples, *shape)).astype(dtype)
    else:
        x = rng.standard_normal((examples, *shape), dtype=np.float32)
    y = rng.integers(0, classes, size=(examples,)).astype("int32")
    return x, y


# ---------------------------------------------------------------- timing


def epoch_timer(base: type, timed: int = 1) -> Any:
    """An instance of a ``base`` (keras or tf_keras Callback) subclass timing each epoch;
    ``rate(steps)``: the steps/s of the last ``timed`` epochs of ``steps`` each."""

    class EpochTimer(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []  # this process's CPU time (the chief's, under PSS)
            self._t0 = self._cpu0 = 0.0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._t0, self._cpu0 = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.seconds.append(time.perf_counter() - self._t0)
            self.cpu_seconds.append(time.process_time() - self._cpu0)

        def rate(self, steps: int) -> float:
            return timed * steps / sum(self.seconds[-timed:])

        def timed_cpu_seconds(self) -> float:
            """CPU seconds per timed epoch."""
            return sum(self.cpu_seconds[-timed:]) / timed

    return EpochTimer()


# ---------------------------------------------------------------- sides

# A side is built once (model, optimizer, input) by a factory and returns a callable
# run(steps) -> steps/s of the timed epochs (after the first).


def _tf_dataset(x: Any, y: Any, batch: int, shard: tuple[int, int] | None = None) -> Any:
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shard is not None:
        ds = ds.shard(shard[1], shard[0])
    return ds.shuffle(SHUFFLE_BUFFER, seed=0).repeat().batch(batch).prefetch(tf.data.AUTOTUNE)


def side_keras_distrib(ctx: "Context", data: Any = None, shuffle: bool = True, exact_epochs: bool = False,
                       k: int | None = None, tf_data: bool = False, files: str | None = None,
                       **fit_options: Any) -> Callable[[int], float]:
    """The Keras 3 trainer (keras_distrib.fit): async PS or all-reduce, by the strategy.

    ``k``: steps per scheduled function (default ``ctx.k``, the benchmark's ``--k``).

    ``exact_epochs``: no ``steps_per_epoch``; each epoch is one pass over exactly
    ``steps`` steps (the examples repeated up to that size), as in a plain
    ``fit(x, y, epochs=...)``: every shard's size is known, and the trainer must find
    where each one ends. ``tf_data``: the examples as an unbatched ``tf.data.Dataset`` of
    known size (``from_tensor_slices``) instead of arrays (with ``steps_per_epoch`` too, so
    exact epochs of tf.data compare with the same tf.data repeated). ``files``: the examples
    as 4 TFRecord files read by a `FileSource` of that recipe (`FILE_RECIPES`) instead.
    """
    import keras
    import numpy as np

    import keras_distrib
    from keras_distrib.trainers import placement

    model = placement.build(lambda: compile_model(ctx.model_fn(keras), keras), ctx.strategy)
    data = (ctx.x, ctx.y) if data is None else data
    k = k or ctx.k

    def run(steps: int) -> float:
        timer = epoch_timer(keras.callbacks.Callback, ctx.timed_epochs)
        epoch_data, steps_per_epoch = data, None if exact_epochs else steps
        if exact_epochs or tf_data or files:
            # ps: each worker's shard gives ``steps`` batches; all-reduce: ``batch`` is global.
            # Both sides of a tf.data or files pair hold these examples: files of another size
            # cache and shuffle another amount of data (4,096 against 15,360 examples made
            # cache=True look 0.88x on the CNN).
            rows = steps * ctx.batch * (ctx.info.num_workers if ctx.mode == "ps" else 1)
            epoch_data = tuple(np.resize(a, (rows, *a.shape[1:])) for a in data)
        if tf_data:
            import tensorflow as tf

            epoch_data = tf.data.Dataset.from_tensor_slices(epoch_data)
        if files:
            epoch_data = records_of(ctx, epoch_data, files)
        # Files: the first epoch counts the shards (all-reduce) and the second starts on the
        # counts; the later ones are timed, as every later epoch of a longer fit runs.
        untimed = 2 if files else 1
        keras_distrib.fit(model, epoch_data, epochs=untimed + ctx.timed_epochs, steps_per_epoch=steps_per_epoch,
                          batch_size=ctx.batch,
                          steps_per_execution=k, shuffle=shuffle, verbose=0, callbacks=[timer],
                          strategy=ctx.strategy, **fit_options)
        ctx.record_chief_cpu(timer.timed_cpu_seconds(), steps, k)
        return timer.rate(steps)

    return run


def side_tf_keras(ctx: "Context", steps_per_execution: int = 1) -> Callable[[int], float]:
    """tf_keras ``model.fit`` under the same strategy (DatasetCreator input, sharded per worker)."""
    import tf_keras

    with ctx.strategy.scope():
        model = compile_model(ctx.model_fn(tf_keras), tf_keras, steps_per_execution=steps_per_execution)
    x, y, batch = ctx.x, ctx.y, ctx.batch

    def dataset_fn(input_context: Any) -> Any:
        # PSS: one pipeline per worker, each step takes `batch`; MWMS: the global batch is split.
        per_replica = input_context.get_per_replica_batch_size(batch) if ctx.mode == "allreduce" else batch
        shard = (input_context.input_pipeline_id, input_context.num_input_pipelines)
        return _tf_dataset(x, y, per_replica, shard)

    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)

    def run(steps: int) -> float:
        timer = epoch_timer(tf_keras.callbacks.Callback, ctx.timed_epochs)
        model.fit(data, epochs=1 + ctx.timed_epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        return timer.rate(steps)

    return run


def side_hand_loop(ctx: "Context", unrolled: bool = False) -> Callable[[int], float]:
    """Minimal hand-written ClusterCoordinator loop: K steps per scheduled tf.function.

    The K steps run in a ``tf.range`` graph loop, or (``unrolled``) a Python loop that
    unrolls them in the trace, as keras_distrib's trainer does.
    """
    import keras
    import tensorflow as tf

    strategy, k = ctx.strategy, ctx.k
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = ctx.model_fn(keras)
        opt = keras.optimizers.Adam(LR)
        opt.build(model.trainable_variables)  # slots on the ps now, not lazily inside the traced step
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y, batch = ctx.x, ctx.y, ctx.batch

    def replica_step(batch_xy: Any) -> Any:
        xb, yb = batch_xy
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_k(iterator: Any) -> Any:
        loss = tf.constant(0.0)
        for _ in range(k) if unrolled else tf.range(k):
            loss = strategy.run(replica_step, args=(next(iterator),))
        return loss

    def run(steps: int) -> float:
        # A fresh per-worker dataset per call, like a fit() call (not timed).
        iterator = iter(coordinator.create_per_worker_dataset(lambda: _tf_dataset(x, y, batch)))
        seconds = []
        for _ in range(2):
            t0 = time.perf_counter()
            for _ in range(max(1, steps // k)):
                coordinator.schedule(train_k, args=(iterator,))
            coordinator.join()
            seconds.append(time.perf_counter() - t0)
        return max(1, steps // k) * k / seconds[-1]

    return run


#: Variants of the parameter-server chunk for the step breakdown (bench/ps_step_breakdown.py),
#: each adding one cost to the previous: see `side_ps_chunk`.
CHUNK_VARIANTS = ("compute", "read", "read_send")


def side_ps_chunk(ctx: "Context", variant: str) -> Callable[[int], float]:
    """K unrolled steps per scheduled closure, stripped down to one cost at a time.

    ``compute``: model and Adam on the worker itself (no ps traffic): forward, backward and
    update only. ``read``: + the variables of a second copy of the model, on the ps, read
    packed once per step (as the trainer does, trainers/packing.py) and used for the step;
    Adam still updates the worker's copy (so steps stay sequential, as in ``compute``).
    ``read_send``: the gradients sent back packed and Adam applied on the ps instead. The full trainer closure (step counter, metrics, exact-epoch bookkeeping) is
    the ``keras_distrib`` side. Closures are scheduled back to back and joined, as the hand
    loop does; the chief's CPU time is recorded per closure.
    """
    import keras
    import tensorflow as tf

    from keras_distrib.trainers import packing

    strategy, k = ctx.strategy, ctx.k
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    def model_and_optimizer() -> tuple[Any, Any]:
        model = ctx.model_fn(keras)
        opt = keras.optimizers.Adam(LR)
        opt.build(model.trainable_variables)
        return model, opt

    with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
        local_model, local_opt = model_and_optimizer()
    with strategy.scope():
        model, opt = model_and_optimizer()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    groups = packing.pack_groups(variables)

    def replica_step(batch_xy: Any) -> Any:
        xb, yb = batch_xy
        if variant == "compute":
            local = local_model.trainable_variables
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, local_model(xb, training=True))
            local_opt.apply_gradients(zip(tape.gradient(loss, local), local))
            return loss
        values = packing.read_packed(variables, groups)
        with tf.GradientTape() as tape:
            tape.watch(values)
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, values)
        if variant == "read":
            local_opt.apply_gradients(zip(grads, local_model.trainable_variables))
        else:
            opt.apply_gradients(zip(packing.send_packed(grads, groups), variables))
        return loss

    @tf.function
    def chunk(iterator: Any) -> Any:
        loss = tf.constant(0.0)
        for _ in range(k):
            loss = strategy.run(replica_step, args=(next(iterator),))
        return loss

    def run(steps: int) -> float:
        iterator = iter(coordinator.create_per_worker_dataset(lambda: _tf_dataset(ctx.x, ctx.y, ctx.batch)))
        closures = max(1, steps // k)
        for timed in (1, ctx.timed_epochs):  # an untimed epoch, then the timed ones
            t0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(closures * timed):
                coordinator.schedule(chunk, args=(iterator,))
            coordinator.join()
        ctx.record_chief_cpu(time.process_time() - cpu0, closures * k * ctx.timed_epochs)
        return closures * k * ctx.timed_epochs / (time.perf_counter() - t0)

    return run


def side_single_process(ctx: "Context") -> Callable[[int], float]:
    """Plain Keras 3 ``model.fit`` in this process alone (no strategy), same K and input."""
    import keras

    model = compile_model(ctx.model_fn(keras), keras, steps_per_execution=ctx.k)
    data = _tf_dataset(ctx.x, ctx.y, ctx.batch)

    def run(steps: int) -> float:
        timer = epoch_timer(keras.callbacks.Callback, ctx.timed_epochs)
        model.fit(data, epochs=1 + ctx.timed_epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        return timer.rate(steps)

    return run


def write_tfrecords(x: Any, y: Any, directory: Path, files: int) -> list[str]:
    """``files`` TFRecord files of tf.train.Examples {"x": floats, "y": int64}."""
    import tensorflow as tf

    directory.mkdir(parents=True, exist_ok=True)
    paths = [str(directory / f"part-{i:03d}.tfrecord") for i in range(files)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    for i in range(len(x)):
        ex = tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i].reshape(-1))),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
        }))
        writers[i % files].write(ex.SerializeToString())
    for w in writers:
        w.close()
    return paths


def tfrecord_spec(shape: tuple[int, ...]) -> dict[str, Any]:
    """The tf.io feature spec of `write_tfrecords`' examples."""
    import numpy as np
    import tensorflow as tf

    return {"x": tf.io.FixedLenFeature([int(np.prod(shape))], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}


def parse_record(shape: tuple[int, ...]) -> Callable[[Any], Any]:
    """parse(record) -> (x, y): one tf.train.Example at a time."""
    import tensorflow as tf

    spec = tfrecord_spec(shape)

    def parse(record: Any) -> Any:
        ex = tf.io.parse_single_example(record, spec)
        return tf.reshape(ex["x"], shape), tf.cast(ex["y"], tf.int32)

    return parse


def parse_records(shape: tuple[int, ...]) -> Callable[[Any], Any]:
    """parse_batch(records) -> (x, y): a whole batch of tf.train.Examples in one op."""
    import tensorflow as tf

    spec = tfrecord_spec(shape)

    def parse_batch(records: Any) -> Any:
        ex = tf.io.parse_example(records, spec)
        return tf.reshape(ex["x"], (-1, *shape)), tf.cast(ex["y"], tf.int32)

    return parse_batch


#: FileSource variants measured by bench/input_stall.py (side ``pipeline_<name>``).
FILE_RECIPES = ("files_per_record", "files", "files_cache")


def file_source(paths: list[str], shape: tuple[int, ...], recipe: str, num_examples: int) -> Any:
    """The FileSource of one recipe: per-record parse; batch-then-parse (the docs/data.md recipe);
    per-record parse with an in-memory cache of the parsed examples."""
    from keras_distrib import data as kd_data

    if recipe == "files_per_record":
        return kd_data.FileSource(paths, parse=parse_record(shape), num_examples=num_examples)
    if recipe == "files":
        return kd_data.FileSource(paths, parse_batch=parse_records(shape), num_examples=num_examples)
    if recipe == "files_cache":
        return kd_data.FileSource(paths, parse=parse_record(shape), cache=True, num_examples=num_examples)
    raise ValueError(recipe)


def records_of(ctx: "Context", arrays: tuple[Any, Any], recipe: str) -> Any:
    """A FileSource of ``recipe`` over 4 TFRecord files of ``arrays``, written once per
    process and size (all-reduce workers each write their own)."""
    x, y = arrays
    written = ctx.__dict__.setdefault("record_sets", {})
    key = f"tfrecords-{os.getpid()}-{len(x)}"
    if key not in written:
        written[key] = write_tfrecords(x, y, Path(ctx.workdir) / key, files=4)
    return file_source(written[key], x.shape[1:], recipe, len(x))


def side_stall(ctx: "Context", kind: str) -> Callable[[int], float]:
    """keras_distrib.fit on one of the keras_distrib.data pipelines, or on one cached batch."""

    from keras_distrib import data as kd_data

    if kind == "arrays":
        return side_keras_distrib(ctx, kd_data.ArraySource((ctx.x, ctx.y)))
    if kind in FILE_RECIPES:
        return side_keras_distrib(ctx, records_of(ctx, (ctx.x, ctx.y), kind))
    # One pre-materialised batch, cached in memory and repeated: no per-step input work. A
    # batched source's batch is one replica's: under all-reduce batch_size is the global
    # batch, split over the replicas (a whole global batch per replica doubled the step).
    rows = ctx.batch // ctx.strategy.num_replicas_in_sync if ctx.info.layout == "allreduce" else ctx.batch
    return side_keras_distrib(ctx, CachedBatch(ctx.x[:rows], ctx.y[:rows]), shuffle=False)


class CachedBatch:
    """A `keras_distrib.data.Source` yielding one in-memory batch forever (every shard).

    Built inside shard() (so the worker builds it) rather than passing an eagerly created
    tf.data.Dataset: under ParameterServerStrategy `keras_distrib.fit` cannot ship an eager
    Dataset to the workers ("Unable to parse tensor proto"). ``drop_remainder=True`` makes the
    batch size static, so the all-reduce trainer knows every batch is full and runs it as it
    runs the repeated real pipelines (no per-step example count).
    """

    #: Batches per shard, for the trainers: "never runs out", as the real pipelines under
    #: steps_per_epoch, so every side runs the same unguarded steps (an unknown size would
    #: keep a guard per step in the parameter-server trainer and slow the reference down).
    num_examples = 1 << 30
    batched = True

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def shard(self, index: int, num_shards: int) -> Any:
        import tensorflow as tf

        one = tf.data.Dataset.from_tensor_slices((self.x, self.y)).batch(len(self.x), drop_remainder=True)
        return one.take(1).cache().repeat()


#: Issue 27 §1: exact epochs (no steps_per_epoch) against the same fit with it, per input kind.
EXACT_EPOCH_SIDES = ["keras_distrib", "keras_distrib_exact_epochs", "keras_distrib_tf_data",
                     "keras_distrib_exact_epochs_tf_data", "keras_distrib_files", "keras_distrib_exact_epochs_files",
                     "keras_distrib_files_cache", "keras_distrib_exact_epochs_files_cache"]
#: (input kind, side without steps_per_epoch, side with it)
EXACT_EPOCH_PAIRS = [("arrays", "keras_distrib_exact_epochs", "keras_distrib"),
                     ("tf.data", "keras_distrib_exact_epochs_tf_data", "keras_distrib_tf_data"),
                     ("FileSource", "keras_distrib_exact_epochs_files", "keras_distrib_files"),
                     ("FileSource cache=True", "keras_distrib_exact_epochs_files_cache", "keras_distrib_files_cache")]


SIDES: dict[str, Callable[["Context"], Callable[[int], float]]] = {
    "keras_distrib": side_keras_distrib,
    "tf_keras": side_tf_keras,
    "tf_keras_k": lambda ctx: side_tf_keras(ctx, steps_per_execution=ctx.k),
    "hand_loop": side_hand_loop,
    "hand_loop_unrolled": lambda ctx: side_hand_loop(ctx, unrolled=True),
    "single_process": side_single_process,
    "keras_distrib_stale_reads": lambda ctx: side_keras_distrib(ctx, ps_stale_reads=True),
    "keras_distrib_local_steps": lambda ctx: side_keras_distrib(ctx, ps_local_steps=True),
    # Local steps synchronise once per closure: twice the steps per closure, half the syncs.
    "keras_distrib_local_steps_2k": lambda ctx: side_keras_distrib(ctx, k=2 * ctx.k, ps_local_steps=True),
    "keras_distrib_exact_epochs": lambda ctx: side_keras_distrib(ctx, exact_epochs=True),
    "keras_distrib_tf_data": lambda ctx: side_keras_distrib(ctx, tf_data=True),
    "keras_distrib_exact_epochs_tf_data": lambda ctx: side_keras_distrib(ctx, exact_epochs=True, tf_data=True),
    **{f"keras_distrib_{recipe}": functools.partial(side_keras_distrib, files=recipe) for recipe in FILE_RECIPES},
    **{f"keras_distrib_exact_epochs_{recipe}": functools.partial(side_keras_distrib, exact_epochs=True, files=recipe)
       for recipe in FILE_RECIPES},
    **{f"ps_chunk_{variant}": functools.partial(side_ps_chunk, variant=variant) for variant in CHUNK_VARIANTS},
    "pipeline_arrays": lambda ctx: side_stall(ctx, "arrays"),
    **{f"pipeline_{recipe}": functools.partial(side_stall, kind=recipe) for recipe in FILE_RECIPES},
    "cached_batch": lambda ctx: side_stall(ctx, "cached"),
}


class Context:
    def __init__(self, args: argparse.Namespace) -> None:
        import keras_distrib

        self.mode = args.mode
        self.model_fn = load_model_fn(args.model)
        self.batch = args.batch
        self.k = args.k
        self.timed_epochs = args.timed_epochs
        self.workdir = args.workdir
        # The strategy first: MultiWorkerMirroredStrategy must exist before any TF op runs.
        self.strategy = keras_distrib.strategy()
        self.info = keras_distrib.cluster()
        import keras

        keras.utils.set_random_seed(0)
        self.x, self.y = synthetic(self.model_fn, args.examples)
        #: Chief CPU milliseconds per K steps (one closure) of each side's timed epochs.
        self.chief_cpu: dict[str, list[float]] = {}
        self.side = ""

    def record_chief_cpu(self, cpu_seconds: float, steps: int, k: int | None = None) -> None:
        self.chief_cpu.setdefault(self.side, []).append(1000 * cpu_seconds * (k or self.k) / steps)


def job_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["ps", "allreduce"])
    p.add_argument("--model", default="mlp")
    p.add_argument("--sides", required=True, help="comma-separated: " + ", ".join(SIDES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="steps per timed epoch")
    p.add_argument("--timed-epochs", type=int, default=1, help="epochs timed per side and round")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=10, help="steps per execution (Keras 3 trainer, hand loop)")
    p.add_argument("--examples", type=int, default=4096)
    p.add_argument("--workdir", default=".")
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)

    ctx = Context(args)
    names = args.sides.split(",")
    runs = {name: SIDES[name](ctx) for name in names}
    rates: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.rounds):
        order = names[i % len(names):] + names[: i % len(names)]
        if i % 2:
            order.reverse()
        for name in order:
            ctx.side = name
            rates[name].append(runs[name](args.steps))
        print(f"  round {i + 1}/{args.rounds}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names) + " steps/s",
              file=sys.stderr, flush=True)
    if ctx.info.is_chief:
        Path(args.result).write_text(json.dumps({"sides": rates, "steps": args.steps, "batch": args.batch,
                                                 "k": args.k, "model": args.model,
                                                 "chief_cpu_ms_per_closure": ctx.chief_cpu}))
    # TensorFlow's teardown with live remote contexts can take seconds; results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- launching (benchmark side)

#: Cluster shapes. "1ps2w": chief + 1 ps + 2 workers, from the worker-per-gpu layout of
#: one emulated node reporting two GPU ids (on a CPU-only machine TensorFlow just uses the
#: CPU; ps-per-node would give 2 ps). "1ps1w": chief + 1 ps + 1 worker (ps-per-node, 1 node).
#: "2w": two all-reduce workers.
CLUSTERS = {
    "1ps2w": ["--nodes", "1", "--layout", "worker-per-gpu", "--gpus-per-node", "0,1"],
    "1ps1w": ["--nodes", "1", "--layout", "ps-per-node"],
    "2w": ["--nodes", "2", "--layout", "allreduce"],
}


def launch(cluster: str, sides: list[str], **options: Any) -> dict[str, list[float]]:
    """One launcher run of this script on ``cluster``; {side: [steps/s per round]}."""
    return launch_result(cluster, sides, **options)["sides"]


def launch_result(cluster: str, sides: list[str], *, model: str, rounds: int, steps: int, batch: int = 64,
                  k: int = 10, examples: int = 4096, timed_epochs: int = 1, workdir: Path,
                  timeout: float = 900) -> dict[str, Any]:
    """`launch`, returning the job's whole result (also ``chief_cpu_ms_per_closure``)."""
    mode = "allreduce" if cluster == "2w" else "ps"
    result = workdir / f"result-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "keras_distrib.local", *CLUSTERS[cluster], "--port-base", str(free_port_base(8)),
           str(Path(__file__).resolve()), mode, "--model", model, "--sides", ",".join(sides),
           "--rounds", str(rounds), "--steps", str(steps), "--batch", str(batch), "--k", str(k),
           "--examples", str(examples), "--timed-epochs", str(timed_epochs), "--workdir", str(workdir),
           "--result", str(result)]
    print(f"  {cluster} {model}: {', '.join(sides)} x {rounds} rounds of {timed_epochs} x {steps} steps",
          file=sys.stderr, flush=True)
    # TF_USE_LEGACY_KERAS=1: tf.keras means tf_keras (the tf_keras sides); Keras 3 is `import keras`.
    # The caller's directory stays importable for --models package.module:fn.
    env = child_env(TF_USE_LEGACY_KERAS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.getcwd()])
    proc = subprocess.run(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"training job failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}")
    for line in proc.stdout.splitlines():
        if "  round " in line:  # the chief's per-round rates (prefixed by the launcher)
            print("  " + line.strip(), file=sys.stderr)
    return json.loads(result.read_text())


if __name__ == "__main__":
    job_main()


def training_parser(doc: str | None, timed_epochs: int = 1) -> Any:
    """The flags shared by the training benchmarks (on top of --smoke/--rounds/--out);
    ``timed_epochs``: the benchmark's default ``--timed-epochs``."""
    from _harness import parser

    p = parser(doc or "")
    p.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn, module:fn, file.py:fn")
    p.add_argument("--batch", type=int, default=64, help="examples per optimizer update (default 64)")
    p.add_argument("--k", type=int, default=10, help="steps per scheduled function / tf.function call (default 10)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed epoch (default per model)")
    p.add_argument("--timed-epochs", type=int, default=timed_epochs,
                   help=f"epochs timed per side and round, after an untimed one (default {timed_epochs}; "
                        "a --smoke run times 1)")
    return p


def absolute_model_spec(spec: str) -> str:
    """``file.py:fn`` with the file made absolute: the training job runs in another directory."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise SystemExit(f"--models {spec!r}: no such file {path}. HINT: give a path to a .py file "
                             "defining fn(keras) -> uncompiled logits model, as file.py:fn")
        return f"{path}:{name}"
    return spec


#: Steps per closure of a --smoke run (see `model_runs`).
SMOKE_K = 2


def model_runs(args: Any, steps_table: dict[str, int], default_steps: int) -> tuple[int, list[tuple[str, str, int, int]]]:
    """(rounds, [(model spec, display name, steps per timed epoch, examples)]) for these flags.

    ``--smoke`` trains the mlp unless ``--models`` was given explicitly, with K=2 unless
    ``--k`` was given (a chunk is traced unrolled: K=10 costs each side seconds of tracing,
    and a smoke run measures nothing).
    """
    defaults = training_parser(None)
    default = args.models == defaults.get_default("models")
    if args.smoke and args.k == defaults.get_default("k"):
        args.k = SMOKE_K
    models = ["mlp"] if args.smoke and default else [absolute_model_spec(m) for m in args.models.split(",")]
    rounds = 1 if args.smoke else args.rounds
    runs = []
    for model in models:
        steps = 20 if args.smoke else args.steps or steps_table.get(model, default_steps)
        runs.append((model, model_name(model), steps, 1024 if args.smoke else 4096))
    return rounds, runs


def timed_epochs(args: Any) -> int:
    """``--timed-epochs`` (a smoke run: 1)."""
    return 1 if args.smoke else args.timed_epochs


def each_model(args: Any, rounds: int, runs: list[tuple[str, str, int, int]],
               launcher: Callable[..., Any] = launch) -> Iterator[tuple[str, Callable[..., Any]]]:
    """Per model of `model_runs`: (display name, run(cluster, sides)) with the shared flags bound.

    All launches share one scratch directory; "NAME: done" is printed after each model.
    ``launcher``: `launch` ({side: rates}) or `launch_result` (the whole result).
    """
    with tempfile.TemporaryDirectory() as tmp:
        for model, name, steps, examples in runs:
            yield name, functools.partial(launcher, model=model, rounds=rounds, steps=steps, batch=args.batch,
                                          k=args.k, examples=examples, timed_epochs=timed_epochs(args),
                                          workdir=Path(tmp))
            print(f"  {name}: done", file=sys.stderr, flush=True)


def throughput_main(doc: str | None, benchmark: str, steps_table: dict[str, int], default_steps: int,
                    compare: Callable[[Any, str, Callable[..., Any]], tuple[list[Any], dict[str, Any]]],
                    title: Callable[[Any, int], str], add_arguments: Callable[[Any], None] | None = None,
                    timed_epochs: int = 1) -> None:
    """The main() of a throughput benchmark: per model, ``compare(args, name, run)`` launches
    its clusters and returns (its comparisons, {label: steps/s per side}); then the table
    titled ``title(args, rounds)`` and the saved results. ``add_arguments(parser)``: the
    benchmark's own options; ``timed_epochs``: its default ``--timed-epochs``."""
    from _harness import print_table, save

    p = training_parser(doc, timed_epochs)
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args()
    rounds, runs = model_runs(args, steps_table, default_steps)
    comparisons: list[Any] = []
    raw: dict[str, Any] = {}
    for name, run in each_model(args, rounds, runs):
        rows, rates = compare(args, name, run)
        comparisons += rows
        raw.update(rates)
    print_table(title(args, rounds), comparisons)
    save(benchmark, comparisons, {"batch": args.batch, "k": args.k, "models": [run[0] for run in runs],
                                  "steps_per_sec": raw}, args.out)
