"""Synchronous all-reduce training for Keras 3 models (MultiWorkerMirroredStrategy).

Every worker runs this loop in lockstep. Why it looks the way it does:

* Keras 3 sums gradients over replicas, so each replica's loss is its compiled loss
  (sum over its real examples) divided by the number of real examples of the whole step,
  plus the regularisation losses divided by the number of replicas.
* No empty batches: each worker's epoch is its shard, batched, followed by an endless
  stream of padding batches (one copy of the shard's first example, weight 0). Every step
  first all-reduces the number of real examples; 0 ends the epoch on every worker at once.
  A worker whose shard ran out therefore computes on one zero-weight example instead of an
  empty batch (BatchNorm, custom layers), and the step's update is the mean gradient over
  exactly the examples left; metrics only see real examples.
* Except when no shard can run out or come up short: with ``steps_per_epoch`` over
  unbatched data (arrays, files), or over batches of a static size (``drop_remainder=True``),
  every worker repeats its non-empty shard, so every batch is full and the step's example
  count is known in advance. Those steps skip the count's
  all-reduce (one collective round trip per step, as costly as the gradients' on a small
  model) and the padding.
* The K steps of a call loop *around* ``strategy.run`` (a loop inside the replica function
  fails with "merge_call called while defining a new graph").
* ``optimizer.iterations`` is exact here (updates are synchronous), so it is the step.
* The model's own ``train_step``/``test_step`` (docs/keras-contract.md) gets the user's
  batches without mask or padding: every input pipeline is cut into the same number of
  non-empty batches (`own_step_batches`), or the input is refused before training.
* Only worker 0 writes: file-writing callbacks and checkpoints of other workers are
  redirected to temporary directories (TensorFlow wants every worker to save).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import data as kd_data
from . import _private_apis as private
from . import steps as step_contract
from ._common import TrainerError, resolve_strategy
from .base import ChunkHooks, Trainer
from .allreduce_input import EpochInput
from .metrics import Totals, all_finite, batch_size_of, step_totals, unpack, zeros_totals

logger = logging.getLogger(__name__)


def _sum_over_workers(strategy: Any, nest: Any, local_replicas: int = 0) -> Any:
    """All-reduce (SUM over every replica) a nest of per-replica tensors (``strategy.run``
    results: plain tensors with one local replica) with one collective: pack, reduce, unpack.

    ``local_replicas`` (> 0): ``nest`` is one value per worker (the same on its replicas), so
    only the first of each worker's ``local_replicas`` replicas contributes (else a worker
    with 2 replicas would count its value twice)."""
    import tensorflow as tf

    def pack(values: Any) -> Any:
        packed = tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in tf.nest.flatten(values)], axis=0)
        if local_replicas > 0:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            packed *= tf.cast(tf.equal(replica % local_replicas, 0), tf.float64)
        return packed

    packed = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(pack, args=(nest,)), axis=None)
    # Shapes and dtypes from the first local replica's values.
    flat = [strategy.experimental_local_results(t)[0] for t in tf.nest.flatten(nest)]
    out, offset = [], 0
    for t in flat:
        size = t.shape.num_elements()
        out.append(tf.cast(tf.reshape(packed[offset:offset + size], t.shape), t.dtype))
        offset += size
    return tf.nest.pack_sequence_as(nest, out)




class AllReduceTrainer(Trainer):
    """Trains a compiled Keras 3 model synchronously with MultiWorkerMirroredStrategy."""

    def __init__(self, model: Any, strategy: Any = None, *, steps_per_execution: int | None = None) -> None:
        super().__init__(model, resolve_strategy(strategy, allow=("allreduce",)), steps_per_execution=steps_per_execution)
        resolver = self.strategy.cluster_resolver
        self.rank = int(resolver.task_id or 0) if resolver is not None else 0
        self.is_chief = resolver is None or resolver.task_type in (None, "chief") or (
            resolver.task_type == "worker" and self.rank == 0
        )
        with self.strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
        self._fns: dict[tuple[bool, int | None], Any] = {}
        self._agree_fn = None
        self._share_state_fn = None

    @property
    def global_step(self) -> Any:
        """Exact number of optimizer updates (synchronous training keeps it exact)."""
        return self.optimizer.iterations

    def reset_functions(self) -> None:
        self._fns.clear()

    # ------------------------------------------------------------ steps (one replica, one batch)
    #
    # As Keras' backend trainers: one method per step, run under ``strategy.run`` by the
    # chunk function `_make_fn`; the model's own train_step/test_step replace them when its
    # class overrides them (`_make_own_step_fn`). ``mask`` marks the real examples (padding
    # weighs 0), ``global_n`` is the number of real examples of the step over all replicas.

    def _losses(self, x: Any, y: Any, y_pred: Any, sw: Any, mask: Any, global_n: Any,
                training: bool, state: list[Any]) -> tuple[Any, Any, Any]:
        """(loss to differentiate, sum of the local real examples' losses incl. regularisation,
        the scope the per-output loss trackers of the metric ``state`` were updated in)."""
        import tensorflow as tf

        model, replicas = self.model, self.strategy.num_replicas_in_sync
        reg = tf.add_n([tf.cast(l, tf.float32) for l in model.losses]) if model.losses else tf.constant(0.0)
        w = mask if sw is None else tf.cast(tf.reshape(sw, tf.shape(mask)), tf.float32) * mask
        # Keras divides every compiled and added loss by the replicas in sync
        # (keras.losses.loss.scale_loss_for_distribution): undo that to get the mean.
        with self.metrics.loss_scope(state) as scope:
            total = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=training)
        mean = tf.cast(total, tf.float32) * replicas - reg
        # Keras' mean over the local batch (padding weighs 0) -> sum over real examples.
        local_sum = mean * tf.cast(batch_size_of(x), tf.float32)
        return local_sum / global_n + reg / replicas, local_sum + reg * tf.reduce_sum(mask), scope

    def _fold(self, totals: dict[str, Any], y: Any, y_pred: Any, sw: Any, mask: Any, loss_sum: Any,
              finite: Any, loss_scope: Any) -> dict[str, Any]:
        """The step's loss, count and metric state folded into ``totals`` (real examples only)."""
        import tensorflow as tf

        real = mask > 0
        keep = lambda t: None if t is None else private.rows_with_logits(t, real)  # noqa: E731
        n = tf.reduce_sum(mask)
        state = self.metrics.update(totals["state"], tf.nest.map_structure(keep, y),
                                    tf.nest.map_structure(keep, y_pred), None if sw is None else keep(sw),
                                    loss_scope=loss_scope, rows=batch_size_of(mask), examples=n)
        # step_totals folds mean*n: pass the sum's mean over the real examples.
        return step_totals(totals, tf.math.divide_no_nan(loss_sum, n), n, state, finite)

    def train_step(self, batch: Any, mask: Any, totals: dict[str, Any], global_n: Any) -> dict[str, Any]:
        import tensorflow as tf

        model = self.model
        x, y, sw = unpack(batch)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss, loss_sum, scope = self._losses(x, y, y_pred, sw, mask, global_n, training=True, state=totals["state"])
        grads = tape.gradient(loss, model.trainable_variables)
        # Sparse (embedding) gradients all-reduced dense: TensorFlow all-gathers
        # IndexedSlices with collectives whose shapes must match on every worker and
        # did not with 3 workers ("Shape mismatch in the collective instance").
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        self.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return self._fold(totals, y, y_pred, sw, mask, loss_sum, all_finite([loss] + list(grads)), scope)

    def test_step(self, batch: Any, mask: Any, totals: dict[str, Any], global_n: Any) -> dict[str, Any]:
        import tensorflow as tf

        x, y, sw = unpack(batch)
        y_pred = self.model(x, training=False)
        _, loss_sum, scope = self._losses(x, y, y_pred, sw, mask, global_n, training=False, state=totals["state"])
        return self._fold(totals, y, y_pred, sw, mask, loss_sum, tf.constant(True), scope)

    # ------------------------------------------------------------ the chunk functions

    def _make_fn(self, training: bool, full_batch: int | None) -> Any:
        """K steps per call; ``full_batch``: every step's known example count (no count, no end);
        ``counts`` (a float32 vector, one per step of the call): each step's known count."""
        import tensorflow as tf

        metrics, strategy = self.metrics, self.strategy
        replica_step = self.train_step if training else self.test_step

        def local_count(mask: Any) -> Any:
            return tf.reduce_sum(mask)

        @step_contract.compiled
        def run_chunk(iterator: Any, num_steps: Any, counts: Any = None) -> dict[str, Any]:
            start = zeros_totals(metrics)
            # Per replica (a node's GPUs are replicas of one worker): the loop carries the
            # same structure as strategy.run returns.
            totals = strategy.run(lambda: tf.nest.map_structure(tf.identity, start))

            def body(i: Any, steps: Any, totals: Any, ended: Any, seen: Any) -> tuple[Any, ...]:
                batch, mask = next(iterator)
                if full_batch is not None or counts is not None:
                    global_n = tf.constant(float(full_batch)) if counts is None else counts[i]
                    return (i + 1, steps + 1, strategy.run(replica_step, args=(batch, mask, totals, global_n)), ended,
                            seen)
                global_n = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(local_count, args=(mask,)), axis=None)
                seen = seen.write(tf.cast(i, tf.int32), global_n)  # each step's count: `EpochInput.learn`
                # Every worker sees the same global count, so all take the same branch.
                return (i + 1, *tf.cond(
                    global_n > 0,
                    lambda: (steps + 1, strategy.run(replica_step, args=(batch, mask, totals, global_n)), ended),
                    lambda: (steps, totals, tf.constant(True))), seen)

            seen = tf.TensorArray(tf.float32, size=0, dynamic_size=True, element_shape=[])
            _, steps, totals, _, seen = tf.while_loop(
                lambda i, steps, totals, ended, seen: tf.logical_and(i < num_steps, tf.logical_not(ended)), body,
                (tf.constant(0, num_steps.dtype), tf.constant(0, tf.int64), totals, tf.constant(False), seen))
            # One all-reduce per call: sums over replicas of the per-replica accumulators.
            def deltas(totals: dict[str, Any]) -> dict[str, Any]:
                return {
                    "loss_sum": totals["loss_sum"],
                    "count": totals["count"],
                    "bad": 1.0 - tf.cast(totals["finite"], tf.float32),
                    "state": [s - r for s, r in zip(totals["state"], start["state"])],
                }

            summed = _sum_over_workers(strategy, strategy.run(deltas, args=(totals,)))
            return {
                "loss_sum": summed["loss_sum"],
                "count": summed["count"],
                "steps": steps,
                "finite": summed["bad"] == 0,
                "state": [d + r for d, r in zip(summed["state"], start["state"])],
                "seen": seen.stack(),
            }

        return run_chunk

    def _make_own_step_fn(self, training: bool) -> Any:
        """K steps of the model's own train_step/test_step per call, under ``strategy.run``;
        what it returns is reduced as Keras' TensorFlow trainer reduces it (the mean over
        replicas) and the last step's is returned with the examples counted."""
        import tensorflow as tf

        strategy = self.strategy
        method = getattr(self.model, "train_step" if training else "test_step")
        user_step = step_contract.compiled_step(method, strategy,
                                                reduce=lambda out: step_contract.mean_over_replicas(strategy, out))

        def local_count(data: Any) -> Any:
            return tf.cast(batch_size_of(unpack(data)[0]), tf.float32)

        @step_contract.compiled
        def run_chunk(iterator: Any, num_steps: Any, logs: Any) -> dict[str, Any]:
            def body(i: Any, count: Any, steps: Any, finite: Any, logs: Any) -> tuple[Any, ...]:
                # Every pipeline yields the same number of real batches (own_step_batches)
                # and `_run` asks for no more: no end to detect, no step skipped.
                data = next(iterator)
                logs = user_step(data)
                count += strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(local_count, args=(data,)), axis=None)
                return i + 1, count, steps + 1, tf.logical_and(finite, step_contract.logs_finite(logs)), logs

            start = (tf.constant(0, num_steps.dtype), tf.constant(0.0), tf.constant(0, tf.int64), tf.constant(True), logs)
            _, count, steps, finite, logs = tf.while_loop(lambda i, *_: i < num_steps, body, start)
            return {"loss_sum": tf.constant(0.0), "count": count, "steps": steps, "finite": finite, "state": [],
                    "logs": logs}

        first: list[Any] = []

        def call(iterator: Any, num_steps: Any) -> dict[str, Any]:
            if not first:
                # The step's first trace (its optimizers built first, see first_trace); its
                # output zeros are the logs before a step ran.
                first.append(step_contract.first_trace(self.model, strategy, user_step, iterator.element_spec))
            return run_chunk(iterator, num_steps, first[0])

        return call

    def _fn(self, training: bool, full_batch: int | None) -> Any:
        key = (training, full_batch)
        if key not in self._fns:
            own = ("train_step" if training else "test_step") in self.custom_steps
            self._fns[key] = self._make_own_step_fn(training) if own else self._make_fn(training, full_batch)
        return self._fns[key]

    def _share_epoch_state(self) -> None:
        """Every replica takes replica 0's layer state (BatchNorm's moving statistics).

        Each worker (each local replica) updates its own copy from its own batches; replica
        0's, on worker 0, is the one the chief saves, so after this validation,
        ``evaluate`` and the saved model agree (they differed by one example of 333 on a
        BatchNorm model with 2 workers). Replica 0 is never padded (longest shard).
        """
        import tensorflow as tf

        state = [v for v in self.model.non_trainable_variables if "float" in str(v.dtype)]
        if not state:
            return
        if self._share_state_fn is None:
            def replica_values() -> list[Any]:
                # A sum over every replica in which only replica 0's values count.
                first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
                return [tf.convert_to_tensor(v) * tf.cast(first, v.dtype) for v in state]

            @step_contract.compiled
            def share() -> None:
                for v, value in zip(state, _sum_over_workers(self.strategy, self.strategy.run(replica_values))):
                    v.assign(value)

            self._share_state_fn = share
        self._share_state_fn()

    def _agree(self, flag: bool) -> bool:
        """True on every worker if any worker's callbacks asked to stop."""
        import tensorflow as tf

        if self._agree_fn is None:
            @step_contract.compiled
            def agree(value: Any) -> Any:
                # Every local replica contributes the flag: a sum > 0 still means "any".
                return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(tf.identity, args=(value,)), axis=None)

            self._agree_fn = agree
        return bool(self._agree_fn(tf.constant(1.0 if flag else 0.0)) > 0)

    # ------------------------------------------------------------ input and runner

    def _per_replica(self, batch_size: int | None) -> int:
        replicas = self.strategy.num_replicas_in_sync
        global_batch = batch_size or step_contract.DEFAULT_BATCH_SIZE
        per_replica = global_batch // replicas
        if per_replica < 1:
            raise TrainerError(
                f"batch_size={global_batch} is smaller than the {replicas} replicas. "
                "HINT: batch_size is the global batch; use at least one example per replica."
            )
        return per_replica

    def _input(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int | None, repeat: bool,
               own_step: str | None = None) -> EpochInput:
        per_replica = None if source.batched else self._per_replica(batch_size)
        pipelines = self._input_pipelines()[1]
        own = (pipelines, own_step) if own_step else None
        return EpochInput(self.strategy, source, per_replica=per_replica, shuffle=shuffle, seed=seed, repeat=repeat,
                          own_step=own, pipelines=pipelines)

    def _release(self, inp: EpochInput) -> None:
        inp.close()

    def _input_pipelines(self) -> tuple[int, int]:
        """(this worker's input pipeline index, number of pipelines): one per task."""
        resolver = self.strategy.cluster_resolver
        if resolver is None or resolver.cluster_spec() is None:
            return 0, 1
        spec = resolver.cluster_spec().as_dict()
        chiefs, workers = len(spec.get("chief", [])), len(spec.get("worker", []))
        offset = 0 if resolver.task_type == "chief" else chiefs
        return offset + int(resolver.task_id or 0), max(1, chiefs + workers)

    def _predict_rows(self, source: Any, *, batch_size: int | None, progress: Any) -> list[tuple[Any, Any]]:
        """Each worker predicts its own shard; then every worker gets every row (`_all_rows`)."""
        import tensorflow as tf

        from . import ordered

        index, count = self._input_pipelines()
        per_replica = None if source.batched else self._per_replica(batch_size)
        ds = kd_data.pipeline(source, index, count, batch_size=per_replica, shuffle=False, seed=None, repeat=False)
        call = self._predict_call()
        spec = ordered.output_spec(self.model, ds.element_spec, call)
        predict_batch = step_contract.compiled(call, retrace_less=True)
        keys, preds = ordered.empty_rows(spec)
        local = [(keys, preds)]
        for batches, (batch_keys, x) in enumerate(ds, start=1):
            local.append((batch_keys, predict_batch(x)))
            progress(batches)
        keys = tf.concat([k for k, _ in local], 0)
        preds = tf.nest.map_structure(lambda *leaves: tf.concat(leaves, 0), *[p for _, p in local])
        return [self._all_rows(index, count, (keys, preds))]

    def _all_rows(self, index: int, count: int, rows: Any) -> Any:
        """Every pipeline's ``rows`` (a nest of tensors of equal length), concatenated, on every worker.

        An all-gather of uneven blocks written with the all-reduce the trainer already uses:
        the block sizes are summed first, then each worker puts its rows (padded to the
        largest block) at its own slot of a zero buffer and the buffers are summed (exact:
        one non-zero term per element, carried as float64).
        """
        import tensorflow as tf

        sizes = np.zeros(count, np.int64)
        sizes[index] = int(tf.nest.flatten(rows)[0].shape[0])
        sizes = np.asarray(self._sum_fn()({"sizes": tf.constant(sizes)})["sizes"])
        widest = int(sizes.max())

        def slot(t: Any) -> Any:
            padded = tf.pad(t, [[0, widest - t.shape[0]]] + [[0, 0]] * (t.shape.rank - 1))
            return tf.pad(padded, [[index * widest, (count - index - 1) * widest]] + [[0, 0]] * (t.shape.rank - 1))

        summed = self._sum_fn()(tf.nest.map_structure(slot, rows))
        real = np.concatenate([np.arange(i * widest, i * widest + sizes[i]) for i in range(count)])
        return tf.nest.map_structure(lambda t: t.numpy()[real], summed)

    def _sum_fn(self) -> Any:

        if getattr(self, "_sum", None) is None:
            # Traced per shape (static shapes pack into one buffer); every worker traces alike.
            local = max(1, self.strategy.num_replicas_in_sync // self._input_pipelines()[1])
            self._sum = step_contract.compiled(lambda nest: _sum_over_workers(self.strategy, nest, local_replicas=local))
        return self._sum

    def _run(self, inp: EpochInput, epoch: int, *, training: bool, steps: int | None, hooks: ChunkHooks) -> Totals:
        """Run the epoch (or ``steps``) in calls of K steps; every worker in lockstep."""
        import tensorflow as tf

        last = self._last_epoch if training and inp.counts is not None and steps is None else None
        fn, iterator = self._fn(training, inp.full_batch), inp.iterator(epoch, last)
        if inp.own_step and steps is None:
            steps = inp.steps  # the model's own step: exactly the epoch's steps (own_step_batches)
        totals = Totals(self.metrics.reset_numpy())
        k = self.steps_per_execution
        counts = inp.counts
        if counts is not None:  # the epoch's steps are known: no step counts, none ends it
            steps = len(counts) if steps is None else min(steps, len(counts))
        learning = inp.sizes.counting and steps is None
        seen: list[int] = []  # each step's examples, where the epoch teaches them (`EpochInput.learn`)
        by_hook = False
        while steps is None or totals.steps < steps:
            if totals.steps and hooks.checkpoint_due(totals.steps):
                hooks.checkpoint_now()  # every worker agreed: lockstep, the step is exact
            n = k if steps is None else min(k, steps - totals.steps)
            hooks.before(totals.steps)
            if counts is None:
                out = fn(iterator, tf.constant(n))
            else:  # padded to K: one trace for every call
                these = counts[totals.steps:totals.steps + n]
                out = fn(iterator, tf.constant(n), tf.constant(these + [0] * (k - n), tf.float32))
            done = int(out["steps"])
            if learning:
                seen += [int(c) for c in np.asarray(out["seen"])[:done]]
            totals.add({key: (np.asarray(v) if key not in ("state", "logs", "seen") else v) for key, v in out.items()})
            if done:
                hooks.after(totals.steps - 1, totals)
            if done < n:
                break
            if self._agree(hooks.stop()):
                by_hook = True
                break
        if learning and not by_hook and totals.steps == len(seen) and sum(seen) == int(totals.count):
            inp.learn(seen)
        if last is not None and totals.steps != len(counts):
            inp.end_stream()  # stopped early: the stream is not at the next epoch's first batch
        if counts is not None and totals.steps == len(counts) and int(totals.count) != sum(counts):
            hint = ("HINT: keep the input's files unchanged during training (steps_per_epoch= avoids the known-size "
                    "path)." if inp.sizes.learned else "HINT: this is a keras_distrib defect; please report it with the "
                    "input's type (steps_per_epoch= avoids the known-size path).")
            raise TrainerError(  # a source whose shard_sizes() (or counted size) do not match its shards
                f"an epoch of {type(inp.source).__name__} was expected to hold {sum(counts)} examples over "
                f"every worker and held {int(totals.count)}{' (as counted in an earlier epoch)' if inp.sizes.learned else ''}. "
                f"{hint}")
        return totals
