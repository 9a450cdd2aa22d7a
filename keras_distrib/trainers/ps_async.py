"""Asynchronous parameter-server training for Keras 3 models (ParameterServerStrategy).

Design notes (why):

* Steps per scheduled function (K, ``steps_per_execution``): a scheduled closure costs
  ~1.5 ms of coordinator overhead, so each closure runs K steps in a loop inside one
  tf.function. Measured on this 2-core box (examples/digits_distrib.py, MLP 64-128-64-10,
  batch 64, 2 workers + 1 ps, last of 6 epochs): K=1 67 steps/s, K=5 176, K=10 190,
  K=20 191 -> default K=10 (the knee; more only delays progress/callback updates).
* Unrolled chunks: the K steps are unrolled in the trace (a Python loop) rather than a
  ``tf.range`` graph loop. A loop whose body touches variables on the ps is split across
  devices, and every iteration then pays cross-device loop control on top of the
  variable traffic; unrolled, each step is plain dataflow. Measured with
  bench/ps_throughput.py's cluster (mlp, 4 rounds, ratio to the hand-written
  ``tf.range`` loop): graph loop 0.90, unrolled 1.13 (cnn 1.04). Chunks longer than
  `MAX_UNROLLED_STEPS`, or of big models (`MAX_UNROLLED_VARIABLE_STEPS`), keep the graph
  loop to bound trace time and graph size.
* Packed variable traffic (trainers/packing.py): each step reads the variables of each
  ps as one flat tensor and sends the gradients back as one, instead of one transfer per
  variable. Measured (same cluster, 600/240 timed steps, 3 rounds, ratio to the unrolled
  hand-written loop): mlp 0.915 -> 1.127, cnn 0.908 -> 1.139.
* Exact step: Keras 3 ``optimizer.iterations`` loses increments under concurrent workers
  (read-modify-write), so a separate int64 ``global_step`` on a ps is advanced with
  ``assign_add`` (atomic on the ps). Each closure starts ``optimizer.iterations`` at the
  counter and adds its K steps with one ``assign_add(K)`` after its last update, so LR
  schedules and Adam's bias correction see the true step (up to the chunks in flight on
  other workers), and at every epoch end the chief sets ``iterations`` to the exact
  counter, so checkpoints and callbacks see it exactly. (If a worker dies mid-closure the
  coordinator re-runs the closure: the lost attempt is not counted, but the updates it
  applied before dying, at most K-1, stay in the weights.)
* Data: each worker gets its own dataset function with its shard index baked in (one
  resource closure per worker, re-run with the same index if the worker is recovered),
  because upstream ``create_per_worker_dataset`` gives every worker the same stream.
* Closure results: every closure returns its loss/count/steps/metric-state sums packed
  into one float64 vector, because the chief pays one remote copy per fetched tensor
  (5 tensors -> 1: chief CPU in the timed epoch of bench/ps_throughput.py mlp 18% ->
  10% of a core, ~199 -> ~231 steps/s). The chunk size is a Python int baked into the
  trace (no chief tensor sent per closure). The chief folds the results in order as they
  arrive, so epoch logs stay exact.
* Callbacks: epoch hooks get the full logs. Batch hooks are called at closure granularity
  (``on_train_batch_begin/end`` with the index of the closure's last step) when that
  closure's result reaches the chief, with running ``loss`` and metrics in ``logs``. The
  running logs (Keras metric results computed eagerly on the chief) are only computed
  when a callback overrides a train-batch hook or ``verbose=1`` shows a progress bar.
* Validation runs as scheduled closures over per-worker shards of ``validation_data``;
  closures are scheduled until every example has been evaluated once.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

from .. import data as kd_data
from ._common import (
    batch_reporter,
    epoch_saver,
    CheckpointKeeper,
    MetricSet,
    Progress,
    Totals,
    TrainerError,
    batch_size_of,
    check_model,
    epoch_steps,
    make_callbacks,
    mean_loss,
    resolve_strategy,
    run_epochs,
    step_totals,
    unpack,
    zeros_totals,
)
from . import packing
from ..checkpoints import preemption_signals
from .placement import placement_scope

#: Default steps per scheduled function (see module docstring for the measurement).
DEFAULT_STEPS_PER_EXECUTION = 10
#: Chunks up to this many steps are unrolled in the trace; longer ones use a graph loop.
MAX_UNROLLED_STEPS = 32
#: ...and only while steps x trainable variables stays below this: trace time and graph
#: size grow with both, and for big models the loop's per-step cost matters little.
MAX_UNROLLED_VARIABLE_STEPS = 4000


def pack_totals(totals: dict[str, Any]) -> Any:
    """A closure's totals as one float64 vector (traced): ``[loss_sum, count, steps, *state]``.

    Fetching a closure's result costs the chief one remote copy per tensor, so the whole
    result travels as one tensor. float64 holds float32 sums and integer counts exactly.
    """
    import tensorflow as tf

    parts = [totals["loss_sum"], totals["count"], totals["steps"], *totals["state"]]
    return tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in parts], axis=0)


def unpack_totals(vector: Any, reset: Sequence[np.ndarray]) -> dict[str, Any]:
    """Inverse of `pack_totals` on the chief; metric states get their reset shapes/dtypes."""
    vector = np.asarray(vector)
    state, i = [], 3
    for r in reset:
        state.append(vector[i:i + r.size].reshape(r.shape).astype(r.dtype))
        i += r.size
    return {"loss_sum": vector[0], "count": vector[1], "steps": int(vector[2]), "state": state}


def needs_batch_hooks(callbacks: Any) -> bool:
    """True if a callback overrides a train-batch hook (Keras' own defaults do nothing)."""
    import keras

    base = keras.callbacks.Callback
    hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    return any(getattr(type(cb), h, None) is not getattr(base, h) for cb in callbacks.callbacks for h in hooks)


class PerWorkerInput:
    """Per-worker iterators over disjoint shards of a `Source`."""

    def __init__(self, coordinator: Any, source: Any, *, batch_size: int | None, shuffle: bool,
                 seed: int | None, repeat: bool) -> None:
        import tensorflow as tf
        from tensorflow.python.distribute import input_lib
        from tensorflow.python.distribute.coordinator import values as coord_values

        workers = coordinator._cluster.workers  # private: needed to give each worker its own fn
        k = len(workers)

        def dataset_fn(index: int) -> Any:
            return kd_data.pipeline(source, index, k, batch_size=batch_size, shuffle=shuffle,
                                    seed=seed, repeat=repeat)

        concrete = [tf.function(lambda i=i: dataset_fn(i)).get_concrete_function() for i in range(k)]
        # The iterator resource is rebuilt by the same closure (same shard) after a worker fails.
        iters = tuple(w.create_resource(lambda c=c: iter(c())) for w, c in zip(workers, concrete))
        spec = input_lib.get_iterator_spec_from_dataset(coordinator.strategy, concrete[0].structured_outputs)
        for rv in iters:
            rv._type_spec = spec
        self.iterator = coord_values.PerWorkerDistributedIterator(iters)
        self.element_spec = concrete[0].structured_outputs.element_spec
        self.sample_dataset = dataset_fn(0)  # local, for building metrics on the chief


class ParameterServerTrainer:
    """Trains a compiled Keras 3 model asynchronously with a ParameterServerStrategy."""

    def __init__(self, model: Any, strategy: Any = None, *, steps_per_execution: int = DEFAULT_STEPS_PER_EXECUTION) -> None:
        import tensorflow as tf

        self.strategy = resolve_strategy(strategy, allow=("ps",))
        self.model = model
        self.optimizer = check_model(model, self.strategy)
        self.steps_per_execution = max(1, int(steps_per_execution))
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)
        self.num_workers = len(self.coordinator._cluster.workers)
        with placement_scope(model), self.strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
            self.global_step = tf.Variable(
                int(self.optimizer.iterations.numpy()), dtype=tf.int64, trainable=False, name="global_step"
            )
        self.metrics = MetricSet(model)
        self._train_fn = None
        self._eval_fn = None

    # ------------------------------------------------------------ traced functions

    def _make_train_fn(self) -> Any:
        import tensorflow as tf

        model, opt, step, metrics, strategy = self.model, self.optimizer, self.global_step, self.metrics, self.strategy

        import keras

        variables = model.trainable_variables
        groups = packing.pack_groups(variables)

        def replica_step(batch: Any, state: list[Any]) -> tuple[Any, Any, list[Any]]:
            x, y, sw = unpack(batch)
            values = packing.read_packed(variables, groups)
            with tf.GradientTape() as tape:
                tape.watch(values)
                with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
                    y_pred = model(x, training=True)
                    loss = mean_loss(model, x, y, y_pred, sw, training=True)
            grads = tape.gradient(loss, values)
            packing.write_back(scope, model.non_trainable_variables)
            opt.apply_gradients(zip(packing.send_packed(grads, groups), variables))
            return loss, batch_size_of(x), metrics.update(state, y, y_pred, sw)

        @tf.function
        def train_chunk(iterator: Any, num_steps: int) -> Any:
            # num_steps is a Python int (K, or an epoch's remainder): a constant in the
            # graph instead of a chief tensor sent with every closure (at most two traces).
            # The chunk's steps are counted with one atomic assign_add on the ps when it
            # completes (below: two remote ops per chunk instead of per step), so a closure
            # lost with its worker is not counted, its re-run is (README "Resilience");
            # iterations starts at the counter, so schedules see the step (up to chunks in flight).
            opt.iterations.assign(tf.cast(step.read_value(), opt.iterations.dtype))
            totals = zeros_totals(metrics)
            # Unrolled (Python range) up to MAX_UNROLLED_STEPS: see the module docstring.
            unroll = num_steps <= MAX_UNROLLED_STEPS and num_steps * len(variables) <= MAX_UNROLLED_VARIABLE_STEPS
            steps = range(num_steps) if unroll else tf.range(num_steps)
            for _ in steps:
                loss, n, state = strategy.run(replica_step, args=(next(iterator), totals["state"]))
                totals = step_totals(totals, loss, n, state)
            # Counted last, after the last update (ordered on iterations) and the result, so
            # a worker lost before that point leaves its closure uncounted.
            packed = pack_totals(totals)
            with tf.control_dependencies([packed, tf.identity(opt.iterations.value)]):
                with tf.control_dependencies([step.assign_add(tf.constant(num_steps, tf.int64))]):
                    return tf.identity(packed)

        return train_chunk

    def _make_eval_fn(self) -> Any:
        import tensorflow as tf

        model, metrics, strategy = self.model, self.metrics, self.strategy

        def replica_step(batch: Any, state: list[Any]) -> tuple[Any, Any, list[Any]]:
            x, y, sw = unpack(batch)
            y_pred = model(x, training=False)
            loss = mean_loss(model, x, y, y_pred, sw, training=False)
            return loss, batch_size_of(x), metrics.update(state, y, y_pred, sw)

        @tf.function
        def eval_chunk(iterator: Any, num_steps: Any) -> Any:
            totals = zeros_totals(metrics)
            for _ in tf.range(num_steps):
                opt = iterator.get_next_as_optional()
                if not opt.has_value():
                    break
                loss, n, state = strategy.run(replica_step, args=(opt.get_value(), totals["state"]))
                totals = step_totals(totals, loss, n, state)
            return pack_totals(totals)

        return eval_chunk

    # ------------------------------------------------------------ helpers

    def _input(self, data: Any, *, batch_size: int | None, shuffle: bool, seed: int | None, repeat: bool) -> tuple[Any, PerWorkerInput]:
        source = kd_data.as_source(data)
        if source.batched:
            batch_size = None
        elif batch_size is None:
            batch_size = 32
        return source, PerWorkerInput(self.coordinator, source, batch_size=batch_size,
                                      shuffle=shuffle, seed=seed, repeat=repeat)

    def _ensure_metrics(self, inp: PerWorkerInput) -> None:
        if self.metrics.metric is not None and not self.metrics.metric.built:
            self.metrics.build(self.model, next(iter(inp.sample_dataset.take(1))))

    def _window(self) -> int:
        # Enough closures in flight to keep every worker busy while the chief fetches.
        return 4 * self.num_workers

    def _run_chunks(self, fn: Any, iterator: Any, total_steps: int, on_chunk: Any = None,
                    static_steps: bool = False, keeper: CheckpointKeeper | None = None) -> Totals:
        """Schedule ``total_steps`` in chunks of K steps; fold results in order.

        ``static_steps``: pass the chunk size as a Python int (``fn`` is traced per size)
        rather than as a tensor.
        """
        import tensorflow as tf

        reset = self.metrics.reset_numpy()
        totals = Totals(reset)
        k = self.steps_per_execution
        pending: deque = deque()

        def drain_one() -> None:
            last, rv = pending.popleft()
            totals.add(unpack_totals(rv.fetch(), reset))
            if on_chunk is not None:
                on_chunk(last, totals)

        # Not one constant per closure.
        sizes = {n: n if static_steps else tf.constant(n) for n in {k, total_steps % k or k}}
        base = int(self.global_step.numpy()) if keeper is not None else 0
        for first in range(0, total_steps, k):
            if keeper is not None and first and keeper.checkpointer.wants_save(base + first):
                # A mid-epoch checkpoint (or a preemption): let the closures in flight land
                # so the saved step counter is exact, then save (and stop if preempted).
                while pending:
                    drain_one()
                self.coordinator.join()
                self.sync_iterations()
                keeper.checkpointer.at_boundary(int(self.global_step.numpy()))
            n = min(k, total_steps - first)
            pending.append((first + n - 1, self.coordinator.schedule(fn, args=(iterator, sizes[n]))))
            if len(pending) >= self._window():
                drain_one()
        while pending:
            drain_one()
        return totals

    # ------------------------------------------------------------ public API

    def fit(
        self,
        data: Any,
        *,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        batch_size: int | None = None,
        callbacks: Sequence[Any] | None = None,
        validation_data: Any = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        verbose: int = 1,
        shuffle: bool = True,
        seed: int | None = 0,
        initial_epoch: int = 0,
        checkpoint_dir: str | None = None,
    ) -> Any:
        """Train ``epochs`` epochs; see `keras_distrib.trainers.fit`."""
        source, inp = self._input(data, batch_size=batch_size, shuffle=shuffle, seed=seed, repeat=True)
        steps = epoch_steps(source.num_examples, None if source.batched else (batch_size or 32), steps_per_epoch, "data")
        if steps is None:
            raise TrainerError("the data has unknown size. HINT: pass steps_per_epoch=...")
        self._ensure_metrics(inp)
        self._train_fn = self._train_fn or self._make_train_fn()

        keeper = None
        resume_skip: dict[int, int] = {}
        if checkpoint_dir:
            keeper = CheckpointKeeper(checkpoint_dir, self.model, self.optimizer, self.global_step, is_chief=True)
            keeper.checkpointer.steps_per_epoch = steps
            if keeper.restore():
                done = int(self.global_step.numpy())
                initial_epoch = max(initial_epoch, done // steps)
                resume_skip[initial_epoch] = done % steps  # a mid-epoch checkpoint
                keeper.checkpointer.nothing_left(done, epochs)

        if validation_data is not None:
            val_source = kd_data.as_source(validation_data)
            val_bs = None if val_source.batched else (validation_batch_size or batch_size or 32)

        cbs = make_callbacks(callbacks, self.model, epochs, steps, verbose)

        def train_epoch(epoch: int, progress: Progress, cbs: Any) -> Totals:
            # Running logs are only worth computing for someone who looks at them.
            per_chunk = verbose == 1 or needs_batch_hooks(cbs)
            on_chunk = batch_reporter(cbs, progress, self.metrics) if per_chunk else None
            totals = self._run_chunks(self._train_fn, inp.iterator, steps - resume_skip.pop(epoch, 0), on_chunk,
                                      static_steps=True, keeper=keeper)
            self.coordinator.join()
            self.sync_iterations()
            return totals

        def validate() -> dict[str, float]:
            return self.evaluate(val_source, steps=validation_steps, batch_size=val_bs, prefix="val_")

        with preemption_signals(enabled=keeper is not None):
            return run_epochs(
                model=self.model, epochs=epochs, initial_epoch=initial_epoch, steps_per_epoch=steps,
                callbacks=cbs, verbose=verbose, show=True, train_epoch=train_epoch,
                validate=validate if validation_data is not None else None,
                train_logs=lambda t: t.logs(self.metrics), on_epoch_done=epoch_saver(keeper, self.global_step),
            )

    def evaluate(self, data: Any, *, steps: int | None = None, batch_size: int | None = None,
                 prefix: str = "") -> dict[str, float]:
        """Distributed evaluation: every example once (or ``steps`` batches); logs dict."""
        source, inp = self._input(data, batch_size=batch_size, shuffle=False, seed=None, repeat=False)
        self._ensure_metrics(inp)
        self._eval_fn = self._eval_fn or self._make_eval_fn()
        totals = Totals(self.metrics.reset_numpy())
        want = steps
        expected = None if steps is not None else source.num_examples
        # Closures land on whichever worker is free, so keep scheduling rounds until the
        # shards are exhausted: all examples counted, or a whole round came back empty.
        while True:
            round_steps = want if want is not None else self.steps_per_execution * 2 * self.num_workers
            part = self._run_chunks(self._eval_fn, inp.iterator, round_steps)
            self.coordinator.join()
            totals.merge(part)
            if want is not None:
                want -= part.steps
                if want <= 0 or part.steps == 0:
                    break
                continue
            counted = totals.steps if source.batched else totals.count
            if part.steps == 0 or (expected is not None and counted >= expected):
                break
        return totals.logs(self.metrics, prefix)

    def reset_functions(self) -> None:
        """Forget traced functions (after changing steps_per_execution)."""
        self._train_fn = self._eval_fn = None

    def sync_iterations(self) -> None:
        """Make ``optimizer.iterations`` equal the exact step counter (call when idle)."""
        self.optimizer.iterations.assign(self.global_step.read_value())

    def checkpoint(self) -> Any:
        """A tf.train.Checkpoint of model, optimizer and the exact step."""
        import tensorflow as tf

        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.global_step)
