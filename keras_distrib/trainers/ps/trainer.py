"""Asynchronous parameter-server training for Keras 3 models (ParameterServerStrategy).

Contracts (the decisions behind them, with their measurements: docs/performance-history.md,
"The parameter-server trainer's decisions"):

* A scheduled closure runs up to K steps (``steps_per_execution``, default 10) of one
  worker's shard and returns its loss/count/steps/metric-state sums packed in one float64
  vector; the chief folds the results in order, so epoch logs are exact.
* Exact step: an int64 ``global_step`` on a ps advances with atomic ``assign_add``; each
  closure reserves its K step numbers, and ``optimizer.iterations`` is set to the counter
  at every epoch end. A closure a dead worker ran is run again (at least once).
* Exact epochs: every example of every shard once per epoch. Arrays and ``tf.data`` of
  known size are handed out dynamically in parts (`DynamicInput`, `DynamicDatasetInput`)
  so a slow worker runs fewer; other inputs keep fixed per-worker shards
  (`PerWorkerInput`), files counted in their first epoch. A step that may find its shard
  ended is guarded; closures every shard can fill run unguarded.
* With ``steps_per_epoch`` the iterators repeat and exactly that many steps run.
* Callbacks see batch hooks at closure granularity; ``model.stop_training`` stops
  scheduling at the next closure.
* Opt-in modes that change the semantics: stale reads (gradients at the closure's first
  read of the weights) and local steps (K steps on a local copy, changes added to the ps).
* A model's own ``train_step``/``test_step`` runs for every step, variables on the ps.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .. import _private_apis as private
from .. import packing
from .. import steps as step_contract
from .._common import TrainerError, refuse_keras_loops, resolve_strategy
from ..base import ChunkHooks, Trainer
from ..metrics import Totals, all_finite, batch_size_of, unpack
from ..lookups import warn_tables_on_the_chief
from ..placement import placement_scope
from .chief import EpochRun, PredictRun
from .compiler import MAX_UNROLLED_STEPS, make_chunk_fn
from .handout import DynamicDatasetInput, DynamicInput, HandOut, PerWorkerInput
from .modes import PsMode, requested_mode

logger = logging.getLogger(__name__)


class ParameterServerTrainer(Trainer):
    """Trains a compiled Keras 3 model asynchronously with a ParameterServerStrategy."""

    def __init__(self, model: Any, strategy: Any = None, *, steps_per_execution: int | None = None,
                 stale_reads: bool = False, local_steps: bool = False) -> None:
        import tensorflow as tf

        super().__init__(model, resolve_strategy(strategy, allow=("ps",)), steps_per_execution=steps_per_execution)
        self._mode = PsMode.DEFAULT
        refuse_keras_loops(model)  # a model built under strategy.scope() gets the clear error too
        warn_tables_on_the_chief(model)
        private.count_broken_worker_rpcs_as_worker_failures()
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self.strategy)
        self.num_workers = len(private.coordinator_workers(self.coordinator))
        with placement_scope(model), self.strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
            self._global_step = tf.Variable(
                int(self.optimizer.iterations.numpy()), dtype=tf.int64, trainable=False, name="global_step"
            )
        private.make_increments_atomic(self.optimizer.iterations)  # no per-step round trip to the worker
        # Each worker's shard index, read by every closure to report whose shard ran out.
        ids = [lambda i=i: iter(tf.data.Dataset.from_tensors(tf.constant(i, tf.int64)).repeat())
               for i in range(self.num_workers)]
        self._shard_ids = private.per_worker_iterator(self.coordinator, ids, tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).repeat())
        self._fns: dict[Any, Any] = {}  # training flag (or predict key) -> chunk function
        #: Exact epochs of unbatched arrays and tf.data of known size handed out dynamically
        #: (`DynamicInput`, `DynamicDatasetInput`); False:
        #: fixed per-worker shards, as for every other input (a slow worker then holds the
        #: epoch back).
        self.dynamic_epochs = True
        self.mode = requested_mode(PsMode.DEFAULT, stale_reads, local_steps)

    @property
    def mode(self) -> PsMode:
        return self._mode

    @mode.setter
    def mode(self, mode: PsMode) -> None:
        step_contract.refuse_custom_step_modes(self.model, stale_reads=mode is PsMode.STALE_READS,
                                               local_steps=mode is PsMode.LOCAL_STEPS)
        if mode is PsMode.LOCAL_STEPS:
            try:  # validated now, before any closure is traced or scheduled
                private.stateless_optimizer(self.optimizer, self.model.trainable_variables)
            except TypeError as exc:
                raise TrainerError(
                    f"ps_local_steps=True cannot run {type(self.optimizer).__name__} on a local copy: {exc}. "
                    "HINT: use Adam, AdamW, SGD, RMSprop, Adagrad, Lion (without gradient_accumulation_steps), "
                    "or drop ps_local_steps."
                ) from None
        if mode is not self._mode:
            self._mode = mode
            self.reset_functions()

    @property
    def global_step(self) -> Any:
        """Exact number of optimizer updates (an int64 variable advanced atomically)."""
        return self._global_step

    def reset_functions(self) -> None:
        self._fns.clear()

    # ------------------------------------------------------------ steps (one batch each)
    #
    # As Keras' backend trainers: one method per step, compiled into the chunk function by
    # `compiler.make_chunk_fn`. Each takes one batch and the metric state and returns
    # ``(loss, examples, metric state, finite, ...)``; the model's own train_step/test_step
    # replace them when its class overrides them (`steps`).

    def _forward(self, x: Any, y: Any, sw: Any, values: list[Any], held: list[Any],
                 state: list[Any]) -> tuple[Any, Any, list[Any], Any]:
        """The gradient block, written once: ``(loss, y_pred, grads, scope)`` with the trainable
        variables read as ``values``, the layer state as ``held`` and the loss trackers as
        their part of the metric ``state`` (a StatelessScope, so the step's new layer state
        and loss trackers are read from ``scope`` and nothing is written meanwhile)."""
        import keras
        import tensorflow as tf

        model = self.model
        mapping = (list(zip(model.trainable_variables, values)) + list(zip(model.non_trainable_variables, held))
                   + self.metrics.loss_mapping(state))
        with tf.GradientTape() as tape:
            tape.watch(values)
            with keras.StatelessScope(state_mapping=mapping) as scope:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True)
        return loss, y_pred, tape.gradient(loss, values), scope

    @staticmethod
    def _new_state(scope: Any, state_variables: list[Any], held: list[Any]) -> list[Any]:
        return [h if scope.get_current_value(v) is None else scope.get_current_value(v)
                for v, h in zip(state_variables, held)]

    def train_step(self, batch: Any, state: list[Any]) -> tuple[Any, Any, list[Any], Any]:
        """One step: packed read of the variables, gradients, packed update on the ps."""
        variables, state_variables = self.model.trainable_variables, self.model.non_trainable_variables
        groups, state_groups = self._groups
        x, y, sw = unpack(batch)
        values = packing.read_packed(variables, groups)
        held = packing.read_packed(state_variables, state_groups)
        loss, y_pred, grads, scope = self._forward(x, y, sw, values, held, state)
        packing.add_back(scope, state_variables, held)  # no update lost between workers
        self.optimizer.apply_gradients(zip(packing.send_packed(grads, groups), variables))
        finite = all_finite([loss] + list(grads))
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), finite

    def test_step(self, batch: Any, state: list[Any]) -> tuple[Any, Any, list[Any], Any]:
        import tensorflow as tf

        model = self.model
        x, y, sw = unpack(batch)
        y_pred = model(x, training=False)
        with self.metrics.loss_scope(state) as scope:
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=False)
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), tf.constant(True)

    def _metrics_after(self, state: list[Any], batch: Any, y_pred: Any, scope: Any) -> list[Any]:
        """The metric ``state`` after one step of ``batch`` (``scope``: where compute_loss ran)."""
        x, y, sw = unpack(batch)
        n = batch_size_of(x)
        return self.metrics.update(state, y, y_pred, sw, loss_scope=scope, rows=n, examples=n)

    def stale_train_step(self, batch: Any, state: list[Any], values: list[Any], held: list[Any]) -> tuple[Any, ...]:
        """Gradients at the closure's snapshot ``values`` (opt-in stale reads); the layer
        state is carried locally from step to step and written back by `apply_stale`."""
        import tensorflow as tf

        x, y, sw = unpack(batch)
        loss, y_pred, grads, scope = self._forward(x, y, sw, values, held, state)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, values)]
        new_held = self._new_state(scope, self.model.non_trainable_variables, held)
        finite = all_finite([loss] + grads)
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), finite, grads, new_held

    def apply_stale(self, grads: list[Any], before: list[Any], after: list[Any]) -> Any:
        import tensorflow as tf

        groups, _ = self._groups
        self.optimizer.apply_gradients(zip(packing.send_packed(grads, groups), self.model.trainable_variables))
        packing.add_changes(self.model.non_trainable_variables, before, after)  # no update lost between workers
        return tf.constant(True)

    def local_train_step(self, batch: Any, state: list[Any], local: tuple[Any, ...], view: Any) -> tuple[Any, ...]:
        """One step on the closure's local copy (``local``: weights, layer state, optimizer
        variables, iterations): Keras' own optimizer math on tensors, nothing on the ps."""
        import keras
        import tensorflow as tf

        opt, variables = self.optimizer, self.model.trainable_variables
        opt_floats = self._opt_floats
        values, held, slots, iterations = local
        x, y, sw = unpack(batch)
        loss, y_pred, grads, scope = self._forward(x, y, sw, values, held, state)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        new_held = self._new_state(scope, self.model.non_trainable_variables, held)
        finite = all_finite([loss] + grads)
        mapping = list(zip(variables, values)) + list(zip(opt_floats, slots)) + [(opt.iterations, iterations)]
        with keras.StatelessScope(state_mapping=mapping) as applied:
            private.stateless_apply(view, grads, variables)
            now = [applied.get_current_value(v) for v in [*variables, *opt_floats, opt.iterations]]
        old = [*values, *slots, iterations]
        now = [o if n is None else n for n, o in zip(now, old)]
        local = (now[:len(values)], new_held, now[len(values):-1], now[-1])
        return loss, batch_size_of(x), self._metrics_after(state, batch, y_pred, scope), finite, local

    @property
    def _groups(self) -> tuple[list[Any], list[Any]]:
        """Packing groups of the trainable variables and of the layer state (see packing)."""
        if getattr(self, "_packing_groups", None) is None:
            self._packing_groups = (packing.pack_groups(self.model.trainable_variables),
                                    packing.pack_groups(self.model.non_trainable_variables))
        return self._packing_groups

    @property
    def _opt_floats(self) -> list[Any]:
        return [v for v in self.optimizer.variables if "float" in str(v.dtype)]

    # ------------------------------------------------------------ the chunk function


    def _fn(self, training: bool) -> Any:
        if training not in self._fns:
            self._fns[training] = make_chunk_fn(self, training)
        return self._fns[training]

    # ------------------------------------------------------------ input and runner

    def _input(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int | None, repeat: bool,
               own_step: str | None = None, countdown: bool = True) -> HandOut:
        # own_step changes nothing here: a worker's shard is its own (never padded) and a
        # closure that finds it exhausted runs no step.
        if source.batched:
            batch_size = None
        elif batch_size is None:
            batch_size = step_contract.DEFAULT_BATCH_SIZE
        if self.dynamic_epochs and countdown and not repeat and DynamicInput.takes(source):
            return DynamicInput(self.coordinator, source, batch_size=batch_size, shuffle=shuffle, seed=seed)
        if self.dynamic_epochs and countdown and not repeat and DynamicDatasetInput.takes(source):
            return DynamicDatasetInput(self.coordinator, source, batch_size=batch_size, shuffle=shuffle, seed=seed)
        return PerWorkerInput(self.coordinator, source, batch_size=batch_size, shuffle=shuffle, seed=seed, repeat=repeat,
                              countdown=countdown)

    def _window(self, per_shard: list[int] | None = None, done: dict[int, int] | None = None,
                k: int | None = None) -> int:
        """Closures to keep in flight: enough to keep every worker busy while the chief
        fetches, and, where each shard's size is known (``per_shard``, ``done``: steps
        folded per shard), no more than the closures its unfinished shards still need.

        A closure that lands on a worker whose shard is finished returns empty but still
        costs the worker a closure (50-100 ms apart, timed in a 2-worker job of a small
        MLP): with the full window at every epoch's end, its epoch of 26 steps took 0.9 s
        instead of 0.45 s (bench/epoch_overhead.py). At least one per worker stays in
        flight, so a worker that still has steps always gets a closure.
        """
        window = 4 * self.num_workers
        if per_shard is None or done is None:
            return window
        k = k or self.steps_per_execution
        needed = sum(-(-max(0, size - done.get(i, 0)) // k) for i, size in enumerate(per_shard))
        return min(window, max(needed, self.num_workers))

    def _scheduler(self, fn: Any, iterator: Any) -> Callable[..., Any]:
        """``schedule(*constants)``: ``fn(iterator, shard ids, *constants)`` on a free worker.

        Each trace (one per distinct ``constants``: the closure size, ...) is looked up once
        here, not by the coordinator for every closure (`_private_apis.scheduled_concrete_function`).
        """
        import tensorflow as tf

        traces: dict[tuple[Any, ...], Any] = {}

        def trace(*constants: Any) -> Any:
            # Tensors (a part's rows) traced at any length: a part's last batch may be short,
            # and one trace per length was one more trace of the whole chunk per shard size.
            key = tuple(("tensor", c.shape.rank) if isinstance(c, tf.Tensor) else c for c in constants)
            if key not in traces:
                started = time.perf_counter()
                spec = (iterator, self._shard_ids, *(tf.TensorSpec([None] * c.shape.rank, c.dtype)
                                                     if isinstance(c, tf.Tensor) else c for c in constants))
                traces[key] = private.scheduled_concrete_function(self.coordinator, fn, spec)
                logger.debug("the trace of a closure for %s: %.2f s", key, time.perf_counter() - started)
            return traces[key]

        def schedule(*constants: Any) -> Any:
            return self.coordinator.schedule(trace(*constants), args=(iterator, self._shard_ids, *constants))

        schedule.trace = trace  # type: ignore[attr-defined]
        return schedule

    def _run(self, inp: Any, epoch: int, *, training: bool, steps: int | None, hooks: ChunkHooks) -> Totals:
        """Schedule closures of K steps until the epoch is complete (`chief.EpochRun`)."""
        return EpochRun(self, inp, epoch, training=training, steps=steps, hooks=hooks).run()

    def _make_predict_fn(self, spec: Any) -> Any:
        import tensorflow as tf

        from .. import ordered

        strategy = self.strategy
        predict_one = self._predict_call()

        def one_batch(iterator: Any, carry: tuple[Any, Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
            keys, preds, batches, exhausted = carry
            optional = iterator.get_next_as_optional()

            def run() -> tuple[Any, Any, Any, Any]:
                batch_keys, x = optional.get_value()
                y = strategy.run(predict_one, args=(x,))
                joined = tf.nest.map_structure(lambda a, b: tf.concat([a, b], 0), preds, y)
                return tf.concat([keys, batch_keys], 0), joined, batches + 1, exhausted

            return tf.cond(optional.has_value(), run, lambda: (keys, preds, batches, tf.constant(True)))

        @step_contract.compiled
        def predict_chunk(iterator: Any, shard_ids: Any, num_steps: int) -> Any:
            shard = next(shard_ids)
            keys, preds = ordered.empty_rows(spec)
            carry = (keys, preds, tf.constant(0, tf.int64), tf.constant(False))
            for _ in range(num_steps):  # unrolled, as in training (module docstring)
                carry = one_batch(iterator, carry)
            keys, preds, batches, exhausted = carry
            return {"shard": shard, "exhausted": exhausted, "batches": batches, "keys": keys, "preds": preds}

        return predict_chunk

    def _predict_rows(self, source: Any, *, batch_size: int | None, progress: Any) -> list[tuple[Any, Any]]:
        """Closures of K batches over every worker's shard; the chief keeps every result."""
        from .. import ordered

        inp = self._input(source, batch_size=batch_size, shuffle=False, seed=None, repeat=False, countdown=False)
        spec = ordered.output_spec(self.model, inp.sample.element_spec, self._predict_call())
        key = ("predict", repr(spec))  # traced once per output structure, not per call
        if key not in self._fns:
            self._fns[key] = self._make_predict_fn(spec)
        fn = self._fns[key]
        schedule = self._scheduler(fn, inp.iterator(0))
        run = PredictRun(self, inp, schedule, min(self.steps_per_execution, MAX_UNROLLED_STEPS), progress)
        run.drain()
        return run.parts  # closures still in flight at completion were folded too (empty or duplicates)

    def _after_train_epoch(self) -> None:
        self.coordinator.join()
        self.sync_iterations()

    def sync_iterations(self) -> None:
        """Make ``optimizer.iterations`` equal the exact step counter (call when idle)."""
        self.optimizer.iterations.assign(self.global_step.read_value())
