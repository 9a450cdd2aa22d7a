"""Synchronous all-reduce training for Keras 3 models (MultiWorkerMirroredStrategy).

Every worker runs this loop in lockstep. Why it looks the way it does:

* Keras 3 sums gradients over replicas, so the loss is
  ``tf.nn.compute_average_loss(per_example_loss, global_batch_size)`` plus the
  regularisation losses scaled by the number of replicas.
* The K steps of a call loop *around* ``strategy.run`` (a loop inside the replica function
  fails with "merge_call called while defining a new graph").
* Uneven shards: each epoch iterates the finite per-worker datasets with
  ``get_next_as_optional``; MWMS agrees on "any worker has data", so a worker whose shard
  ran out gets empty batches until all are done: no hang, nothing dropped.
* ``optimizer.iterations`` is exact here (updates are synchronous), so it is the step.
* Only worker 0 writes: file-writing callbacks and checkpoints of other workers are
  redirected to temporary directories (TensorFlow wants every worker to save).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Sequence

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
    redirect_writers,
    resolve_strategy,
    run_epochs,
    step_totals,
    unpack,
    zeros_totals,
)
from ..checkpoints import preemption_signals

DEFAULT_STEPS_PER_EXECUTION = 10


def per_example_loss_fn(model: Any) -> Any:
    """``fn(y, y_pred, sample_weight) -> per-example loss`` for a single compiled loss.

    Returns None for multi-output/dict losses; the caller then falls back to the
    compiled mean loss rescaled to the global batch (same value, see `_replica_loss`).
    """
    import keras

    loss = getattr(model, "loss", None)
    if loss is None or isinstance(loss, (list, tuple, dict)) or len(model.outputs or [None]) != 1:
        return None
    loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        config = dict(loss.get_config(), reduction="none")
        try:
            loss = loss.__class__.from_config(config)
        except (TypeError, ValueError):
            return None

        def call(y: Any, y_pred: Any, sw: Any) -> Any:
            return loss(y, y_pred, sample_weight=sw)

        return call
    if callable(loss):
        def call_fn(y: Any, y_pred: Any, sw: Any) -> Any:
            values = loss(y, y_pred)
            return values if sw is None else values * keras.ops.cast(keras.ops.reshape(sw, keras.ops.shape(values)), values.dtype)

        return call_fn
    return None


def _sum_over_workers(strategy: Any, nest: Any) -> Any:
    """All-reduce (SUM) a nest of tensors with one collective: pack, reduce, unpack."""
    import tensorflow as tf

    flat = tf.nest.flatten(nest)
    packed = tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in flat], axis=0)
    packed = strategy.reduce(tf.distribute.ReduceOp.SUM, packed, axis=None)
    out, offset = [], 0
    for t in flat:
        size = t.shape.num_elements()
        out.append(tf.cast(tf.reshape(packed[offset:offset + size], t.shape), t.dtype))
        offset += size
    return tf.nest.pack_sequence_as(nest, out)


class AllReduceTrainer:
    """Trains a compiled Keras 3 model synchronously with MultiWorkerMirroredStrategy."""

    def __init__(self, model: Any, strategy: Any = None, *, steps_per_execution: int = DEFAULT_STEPS_PER_EXECUTION) -> None:
        self.strategy = resolve_strategy(strategy, allow=("allreduce",))
        self.model = model
        self.optimizer = check_model(model, self.strategy)
        self.steps_per_execution = max(1, int(steps_per_execution))
        resolver = self.strategy.cluster_resolver
        self.rank = int(resolver.task_id or 0) if resolver is not None else 0
        self.is_chief = resolver is None or resolver.task_type in (None, "chief") or (
            resolver.task_type == "worker" and self.rank == 0
        )
        with self.strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
        self.metrics = MetricSet(model)
        self._per_example = per_example_loss_fn(model)
        self._fns: dict[tuple[bool, int], Any] = {}

    @property
    def global_step(self) -> Any:
        """Exact number of optimizer updates (synchronous training keeps it exact)."""
        return self.optimizer.iterations

    def reset_functions(self) -> None:
        self._fns.clear()

    # ------------------------------------------------------------ traced functions

    def _replica_loss(self, x: Any, y: Any, y_pred: Any, sw: Any, global_batch: int, training: bool) -> tuple[Any, Any]:
        """(loss to differentiate, mean loss of the local batch for logging)."""
        import tensorflow as tf

        replicas = self.strategy.num_replicas_in_sync
        reg = tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]) if self.model.losses else 0.0
        n = tf.cast(batch_size_of(x), tf.float32)
        if self._per_example is not None:
            per_example = tf.cast(self._per_example(y, y_pred, sw), tf.float32)
            per_example = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
            per_example = tf.reduce_mean(per_example, axis=-1)
            scaled = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            local_mean = tf.math.divide_no_nan(tf.reduce_sum(per_example), n)
        else:
            # Compiled mean (sum/n) * n/global == sum/global == compute_average_loss.
            local_mean = tf.cast(self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=training), tf.float32) - reg
            scaled = local_mean * n / global_batch
        return scaled + reg / replicas, local_mean + reg

    def _make_fn(self, training: bool, global_batch: int) -> Any:
        import tensorflow as tf

        model, opt, metrics, strategy = self.model, self.optimizer, self.metrics, self.strategy

        def replica_step(batch: Any, totals: dict[str, Any]) -> dict[str, Any]:
            x, y, sw = unpack(batch)
            if training:
                with tf.GradientTape() as tape:
                    y_pred = model(x, training=True)
                    loss, log_loss = self._replica_loss(x, y, y_pred, sw, global_batch, True)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            else:
                y_pred = model(x, training=False)
                _, log_loss = self._replica_loss(x, y, y_pred, sw, global_batch, False)
            return step_totals(totals, log_loss, batch_size_of(x), metrics.update(totals["state"], y, y_pred, sw))

        @tf.function
        def run_chunk(iterator: Any, num_steps: Any) -> dict[str, Any]:
            start = zeros_totals(metrics)
            totals = start
            steps = tf.constant(0, tf.int64)
            for _ in tf.range(num_steps):
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    break
                totals = strategy.run(replica_step, args=(optional.get_value(), totals))
                steps += 1
            # One all-reduce per call: sums over workers of the per-worker accumulators.
            deltas = {
                "loss_sum": totals["loss_sum"],
                "count": totals["count"],
                "state": [s - r for s, r in zip(totals["state"], start["state"])],
            }
            summed = _sum_over_workers(strategy, deltas)
            return {
                "loss_sum": summed["loss_sum"],
                "count": summed["count"],
                "steps": steps,
                "state": [d + r for d, r in zip(summed["state"], start["state"])],
            }

        return run_chunk

    def _fn(self, training: bool, global_batch: int) -> Any:
        key = (training, global_batch)
        if key not in self._fns:
            self._fns[key] = self._make_fn(training, global_batch)
        return self._fns[key]

    # ------------------------------------------------------------ helpers

    def _batches(self, batch_size: int | None) -> tuple[int, int]:
        replicas = self.strategy.num_replicas_in_sync
        global_batch = batch_size or 32
        per_replica = global_batch // replicas
        if per_replica < 1:
            raise TrainerError(
                f"batch_size={global_batch} is smaller than the {replicas} replicas. "
                "HINT: batch_size is the global batch; use at least one example per replica."
            )
        return per_replica, per_replica * replicas

    def _distributed(self, source: Any, per_replica: int, *, shuffle: bool, seed: int | None, repeat: bool) -> Any:
        import tensorflow as tf

        def dataset_fn(ctx: tf.distribute.InputContext) -> Any:
            return kd_data.pipeline(source, ctx.input_pipeline_id, ctx.num_input_pipelines,
                                    batch_size=None if source.batched else per_replica,
                                    shuffle=shuffle, seed=seed, repeat=repeat)

        sample = dataset_fn(tf.distribute.InputContext(1, 0, 1))
        return self.strategy.distribute_datasets_from_function(dataset_fn), sample

    def _ensure_metrics(self, sample: Any) -> None:
        if self.metrics.metric is not None and not self.metrics.metric.built:
            self.metrics.build(self.model, next(iter(sample.take(1))))

    def _global_batch_for(self, source: Any, per_replica: int, global_batch: int, sample: Any) -> int:
        if not source.batched:
            return global_batch
        dim = sample.element_spec
        import tensorflow as tf

        first = tf.nest.flatten(dim)[0].shape[0]
        if first is None:
            first = int(tf.shape(tf.nest.flatten(next(iter(sample.take(1))))[0])[0])
        return int(first) * self.strategy.num_replicas_in_sync

    def _run(self, fn: Any, iterator: Any, steps: int | None, on_chunk: Any = None,
             keeper: CheckpointKeeper | None = None) -> Totals:
        """Run up to ``steps`` (None: until the data ends) in calls of K steps."""
        import tensorflow as tf

        totals = Totals(self.metrics.reset_numpy())
        k = self.steps_per_execution
        base = int(self.global_step.numpy()) if keeper is not None else 0
        while steps is None or totals.steps < steps:
            if keeper is not None and totals.steps and self._all_agree(keeper.checkpointer.wants_save(base + totals.steps)):
                keeper.checkpointer.at_boundary(int(self.global_step.numpy()))  # may stop: preempted
            n = k if steps is None else min(k, steps - totals.steps)
            out = fn(iterator, tf.constant(n))
            done = int(out["steps"])
            totals.add(out)
            if done and on_chunk is not None:
                on_chunk(totals.steps - 1, totals)
            if done < n:
                break
        return totals

    def _all_agree(self, wanted: bool) -> bool:
        """True on every worker if any wants a checkpoint now (clocks and signals differ)."""
        import tensorflow as tf

        if getattr(self, "_agree_fn", None) is None:
            strategy = self.strategy

            @tf.function
            def agree(flag: Any) -> Any:
                return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(tf.identity, args=(flag,)), axis=None)

            self._agree_fn = agree
        return float(self._agree_fn(tf.constant(1.0 if wanted else 0.0))) > 0

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
        """Train ``epochs`` epochs in lockstep on every worker; see `keras_distrib.trainers.fit`."""
        source = kd_data.as_source(data)
        per_replica, global_batch = self._batches(batch_size)
        repeat = steps_per_epoch is not None
        dist, sample = self._distributed(source, per_replica, shuffle=shuffle, seed=seed, repeat=repeat)
        self._ensure_metrics(sample)
        fn = self._fn(True, self._global_batch_for(source, per_replica, global_batch, sample))
        # Progress target: the longest shard decides how many lockstep steps an epoch has.
        workers = max(1, self.strategy.num_replicas_in_sync)
        if steps_per_epoch is None and source.num_examples is not None:
            longest = kd_data.shard_sizes(source.num_examples, workers)[0]
            target = epoch_steps(longest, None if source.batched else per_replica, None, "data")
        else:
            target = steps_per_epoch

        tmpdir = None if self.is_chief else tempfile.mkdtemp(prefix="keras_distrib_worker_")
        callbacks = list(callbacks or [])
        if tmpdir:
            redirect_writers(callbacks, tmpdir)
        keeper = None
        resume_skip: dict[int, int] = {}
        if checkpoint_dir:
            keeper = CheckpointKeeper(checkpoint_dir, self.model, self.optimizer, self.global_step, is_chief=self.is_chief)
            keeper.checkpointer.steps_per_epoch = target
            if keeper.restore() and target:
                done = int(self.global_step.numpy())
                initial_epoch = max(initial_epoch, done // target)
                resume_skip[initial_epoch] = done % target  # a mid-epoch checkpoint
                keeper.checkpointer.nothing_left(done, epochs)
        cbs = make_callbacks(callbacks, self.model, epochs, target, verbose)
        persistent = iter(dist) if repeat else None

        def train_epoch(epoch: int, progress: Progress, cbs: Any) -> Totals:
            on_chunk = batch_reporter(cbs, progress, self.metrics)
            iterator = persistent if persistent is not None else iter(dist)
            skip = resume_skip.pop(epoch, 0)
            return self._run(fn, iterator, (steps_per_epoch or target) - skip if skip else steps_per_epoch, on_chunk, keeper)

        def validate() -> dict[str, float]:
            return self.evaluate(validation_data, steps=validation_steps,
                                 batch_size=validation_batch_size or batch_size, prefix="val_")

        try:
            with preemption_signals(enabled=keeper is not None):
                return run_epochs(
                    model=self.model, epochs=epochs, initial_epoch=initial_epoch, steps_per_epoch=target,
                    callbacks=cbs, verbose=verbose, show=self.is_chief, train_epoch=train_epoch,
                    validate=validate if validation_data is not None else None,
                    train_logs=lambda t: t.logs(self.metrics), on_epoch_done=epoch_saver(keeper, self.global_step),
                )
        finally:
            if keeper is not None:
                keeper.close()
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)

    def evaluate(self, data: Any, *, steps: int | None = None, batch_size: int | None = None,
                 prefix: str = "") -> dict[str, float]:
        """Evaluate every example once (or ``steps`` batches), in lockstep; logs dict."""
        source = kd_data.as_source(data)
        per_replica, global_batch = self._batches(batch_size)
        dist, sample = self._distributed(source, per_replica, shuffle=False, seed=None, repeat=False)
        self._ensure_metrics(sample)
        fn = self._fn(False, self._global_batch_for(source, per_replica, global_batch, sample))
        return self._run(fn, iter(dist), steps).logs(self.metrics, prefix)

    def checkpoint(self) -> Any:
        """A tf.train.Checkpoint of model, optimizer and the exact step."""
        import tensorflow as tf

        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.global_step)
