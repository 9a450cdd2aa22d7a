"""`Trainer`: fit/evaluate, the epoch loop and checkpointing, written once.

Modelled on Keras' own split (``keras.src.trainers.trainer.Trainer`` writes ``fit`` once;
the backend trainers supply the step). Subclasses supply:

* ``_input(source, ...)``: an input object with ``steps`` (steps per epoch when known)
  and ``sample`` (a local dataset to build metrics from);
* ``_run(inp, epoch, training, steps, hooks)``: run one epoch (or ``steps``) of the
  input and return the `Totals`, calling ``hooks`` at every scheduled-function boundary;
* ``global_step``, ``is_chief``, ``_after_train_epoch`` and ``_share_epoch_state``.

Epoch rule (both layouts): an epoch is every example of every worker's shard exactly
once (``steps_per_epoch`` not given). Each worker batches its own shard, so the final
batch of each shard may be short: up to one short batch per worker per epoch.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .. import data as kd_data
from .. import progress
from ..checkpoints import Meta, Preempted, preemption_signals, resume_position, where_in_training
from . import _private_apis as private
from . import callbacks as cb_utils
from . import steps as step_contract
from ._common import CheckpointKeeper, TrainerError, check_model
from .metrics import MetricSet, Totals
from .stragglers import straggler_note

logger = logging.getLogger(__name__)


@dataclass
class ChunkHooks:
    """What a runner calls around each scheduled function (one chunk of K steps)."""

    before: Callable[[int], None]
    after: Callable[[int, Totals], None]
    stop: Callable[[], bool]
    #: ``checkpoint_due(steps_done)``: a periodic checkpoint or a preemption is due (the
    #: same answer on every process); the runner then makes the step exact (drains what is
    #: in flight) and calls ``checkpoint_now()``, which saves and, after a preemption, stops.
    checkpoint_due: Callable[[int], bool] = lambda _steps: False
    checkpoint_now: Callable[[], None] = lambda: None


def class_weights_to_sample_weights(y: Any, class_weight: dict[int, float]) -> np.ndarray:
    """Keras' rule: the weight of each example's class (one-hot/probabilities: argmax)."""
    y = np.asarray(y)
    labels = y.argmax(axis=-1) if y.ndim > 1 and y.shape[-1] > 1 else y.reshape(len(y), -1)[:, 0]
    labels = np.round(labels).astype(np.int64)
    table = np.ones(int(max(labels.max(initial=0), max(class_weight, default=0))) + 1, np.float32)
    for k, v in class_weight.items():
        table[int(k)] = v
    return table[labels]


def as_data(x: Any, y: Any = None, sample_weight: Any = None, class_weight: Any = None) -> Any:
    """Keras' fit(x, y, sample_weight, class_weight) arguments as one data object."""
    if class_weight is not None:
        if sample_weight is not None:
            raise TrainerError(
                "class_weight and sample_weight were both given. HINT: multiply the class "
                "weights into sample_weight yourself (Keras refuses both too)."
            )
        if y is None:
            raise TrainerError(
                "class_weight needs arrays x and y. HINT: with a dataset, map class weights "
                "into a third (sample_weight) element of each batch."
            )
        sample_weight = class_weights_to_sample_weights(y, class_weight)
    if y is None and sample_weight is None:
        return x
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def fit_sources(x: Any, y: Any, sample_weight: Any, class_weight: Any, validation_split: float,
                validation_data: Any) -> tuple[Any, Any]:
    """fit's training and validation inputs as sources (validation None without any), once per fit."""
    source = kd_data.as_source(as_data(x, y, sample_weight, class_weight), "x")
    val_source = None if validation_data is None else kd_data.as_source(validation_data, "validation_data")
    if validation_split and validation_data is None:  # Keras: validation_data wins
        # Keras: the last fraction, before shuffling
        halves = source.split(int((source.num_examples or 0) * (1.0 - validation_split)))
        if halves is None:
            raise TrainerError(
                f"validation_split={validation_split} needs in-memory arrays (x, y). HINT: pass "
                "validation_data= for a dataset or a keras_distrib.data source."
            )
        source, val_source = halves
    return source, val_source


class Trainer:
    """Distributed fit/evaluate for a compiled Keras 3 model; see the module docstring."""

    def __init__(self, model: Any, strategy: Any, *, steps_per_execution: int | None = None) -> None:
        self.strategy = strategy
        self.model = model
        self.optimizer = check_model(model, strategy)
        step_contract.check_compile_knobs(model)
        self.steps_per_execution = step_contract.steps_per_execution(model, steps_per_execution)
        #: The step methods the model's class overrides: those run instead of ours.
        self.custom_steps = step_contract.overridden_steps(model)
        self.metrics = MetricSet(model)
        #: Per trained epoch: {"epoch", "seconds", "steps", "steps_per_sec",
        #: "worker_steps_per_sec": {worker: steps/s over the seconds its closures ran on it}}
        #: (public; seconds exclude validation).
        self.epoch_stats: list[dict[str, Any]] = []
        self._last_epoch = -1  # the last epoch of the running fit (`_epoch_loop`)

    # ------------------------------------------------------------ subclass interface

    is_chief: bool = True
    #: Training steps each worker ran in the last epoch ({worker index: steps}); filled by
    #: runners that can tell (parameter server), empty in lockstep all-reduce.
    worker_steps: dict[int, int] = {}
    #: Seconds each worker of `worker_steps` was busy in that epoch (its closures' run time on
    #: its own clock), where known: its steps/s is over those, so neither a smaller shard nor
    #: a chief slow to read its results is taken for a slow worker.
    worker_busy: dict[int, float] = {}
    #: True when a worker failed in the last epoch and its closures ran again: the epoch's
    #: per-worker rates measure the recovery, not a worker's speed (stragglers.py).
    workers_recovered: bool = False
    #: The checkpoint keeper of the fit() in progress (None: no checkpoint_dir).
    _keeper: CheckpointKeeper | None = None

    @property
    def global_step(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _input(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int | None,
               repeat: bool, own_step: str | None = None) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _run(self, inp: Any, epoch: int, *, training: bool, steps: int | None,
             hooks: ChunkHooks) -> Totals:  # pragma: no cover - abstract
        raise NotImplementedError

    def _after_train_epoch(self) -> None:
        """Called once an epoch's training steps are all done (before validation)."""

    def _release(self, inp: Any) -> None:
        """Called by every process when ``fit``'s epochs are done: free what ``inp`` holds."""

    def _share_epoch_state(self) -> None:
        """Called by every process in ``fit`` after `_after_train_epoch` (a collective may run)."""

    def _agree(self, flag: bool) -> bool:
        """``flag`` made the same on every process that runs this loop (all-reduce)."""
        return flag

    def reset_functions(self) -> None:
        """Forget traced functions (after changing steps_per_execution)."""

    # ------------------------------------------------------------ checkpointing (one place)

    def _checkpoint_keeper(self, checkpoint_dir: str | None, steps_per_epoch: int) -> CheckpointKeeper | None:
        if not checkpoint_dir:
            return None
        keeper = CheckpointKeeper(checkpoint_dir, self.model, self.optimizer, self.global_step, is_chief=self.is_chief)
        keeper.checkpointer.steps_per_epoch = steps_per_epoch
        return keeper

    def _resume(self, keeper: CheckpointKeeper | None, steps_per_epoch: int, initial_epoch: int,
                epochs: int) -> tuple[int, int]:
        """(first epoch, steps of it already done) after restoring the newest checkpoint.

        A mid-epoch checkpoint resumes that epoch for its remaining step count, over a
        fresh pass of the shards (docs/faults.md, Checkpoints: which examples that is).
        """
        if keeper is None or not keeper.restore():
            return initial_epoch, 0
        self._after_train_epoch()
        done = int(self.global_step.numpy())
        checkpointer = keeper.checkpointer
        meta = checkpointer.restored
        # The meta's place, mapped when the steps per epoch changed with the workers (elastic).
        epoch, skip = resume_position(meta, steps_per_epoch) if meta is not None else divmod(done, steps_per_epoch)
        checkpointer.origin = (done - skip, epoch)  # later saves count epochs from the resumed one
        checkpointer.nothing_left(done, epochs)
        if epoch < initial_epoch:
            checkpointer.origin = (done, initial_epoch)
            return initial_epoch, 0
        return epoch, skip

    def _workers_changed(self, callbacks: Sequence[Any], old: int | None, new: int | None) -> None:
        """A resume on another number of workers (an elastic job re-formed): say so, call the users' hook.

        The default keeps the global batch (a ps step is one worker's batch, an all-reduce
        step the whole batch) and the learning rate; a callback with ``on_workers_changed(old,
        new)`` may change them (Horovod's ``on_reset``), e.g. scale the learning rate.
        """
        if not old or not new or old == new:
            return
        hooks = [cb for cb in callbacks if callable(getattr(cb, "on_workers_changed", None))]
        if self.is_chief:
            logger.info(f"resuming on {new} workers (the checkpoint was saved on {old}): the global batch and the "
                        f"learning rate are kept{f'; calling on_workers_changed({old}, {new})' if hooks else ''}.")
        for cb in hooks:
            cb.on_workers_changed(old, new)

    def _save_checkpoint(self, keeper: CheckpointKeeper | None, next_epoch: int) -> None:
        """The checkpoint at an epoch's end: it records the start of ``next_epoch``, whatever
        the steps per epoch were thought to be (files dealt whole to workers: estimated from
        ``num_examples`` before the first epoch, and a resume once placed it mid-epoch)."""
        if keeper is not None:
            step = int(self.global_step.numpy())
            keeper.checkpointer.origin = (step, next_epoch)
            progress.training_ended(next_epoch > self._last_epoch)  # before the checkpoint is noted
            keeper.save(step)

    # ------------------------------------------------------------ shared helpers

    def _ensure_metrics(self, inp: Any) -> None:
        if self.metrics.needs_build:
            import contextlib

            # The model's own steps update the compiled metrics' variables in place (as
            # Keras, which builds them under the strategy); ours only read their shapes.
            scope = self.strategy.scope() if self.custom_steps else contextlib.nullcontext()
            with scope:
                self.metrics.build(self.model, next(iter(inp.sample.take(1))))

    def _prepare(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int | None, repeat: bool,
                 training: bool) -> Any:
        """The input object of a `keras_distrib.data.Source` (made once per fit by `as_source`)."""
        # own_step: the model's own step will see these batches (all-reduce shapes them for it).
        method = "train_step" if training else "test_step"
        own_step = method if method in self.custom_steps else None
        inp = self._input(source, batch_size=batch_size, shuffle=shuffle, seed=seed, repeat=repeat, own_step=own_step)
        self._ensure_metrics(inp)
        return inp

    def _hooks(self, callbacks: Any, epoch: int, training: bool) -> ChunkHooks:
        """Batch callbacks at chunk granularity (begin before the chunk is run/scheduled,
        end with running logs once its result is in), the non-finite check and the stop
        flag, at every scheduled-function boundary."""
        begin = callbacks.on_train_batch_begin if training else callbacks.on_test_batch_begin
        end = callbacks.on_train_batch_end if training else callbacks.on_test_batch_end
        wants_logs = cb_utils.needs_batch_logs(callbacks)

        def after(last: int, totals: Totals) -> None:
            progress.tick()  # the agent's hang watchdog (keras_distrib/progress.py): one memory write
            if training and not totals.finite:
                what = ("a non-finite value returned by the model's train_step" if totals.last is not None
                        else f"non-finite loss or gradients (loss {totals.loss_sum / max(totals.count, 1):.4g})")
                raise TrainerError(
                    f"{what} in epoch {epoch + 1}, by step {last + 1}; training stopped. "
                    "HINT: lower the learning rate, check the inputs for NaN/inf, or clip gradients "
                    "(optimizer clipnorm=...)."
                )
            end(last, totals.logs(self.metrics) if wants_logs else {})

        def stop() -> bool:
            return bool(training and getattr(self.model, "stop_training", False))

        keeper = self._keeper if training else None
        if keeper is None:
            return ChunkHooks(before=begin, after=after, stop=stop)
        start = int(self.global_step.numpy())

        def checkpoint_due(steps_done: int) -> bool:
            return self._agree(keeper.checkpointer.wants_save(start + steps_done))

        def checkpoint_now() -> None:
            keeper.checkpointer.at_boundary(int(self.global_step.numpy()))

        return ChunkHooks(before=begin, after=after, stop=stop, checkpoint_due=checkpoint_due,
                          checkpoint_now=checkpoint_now)

    def _logs(self, totals: Totals, method: str = "train_step") -> dict[str, Any]:
        """The logs of a finished epoch / evaluation (the model's own step: Keras' rule)."""
        if totals.last is not None:
            return step_contract.epoch_logs(self.model, totals.last, method)
        return totals.logs(self.metrics)

    def _reset_model_metrics(self, training: bool) -> None:
        """Keras resets the model's metrics before each epoch and each evaluation; only the
        model's own steps use them (ours keep exact sums instead, see `metrics`)."""
        if ("train_step" if training else "test_step") in self.custom_steps:
            self.model.reset_metrics()

    def _evaluate(self, inp: Any, callbacks: Any, *, steps: int | None, prefix: str) -> dict[str, float]:
        callbacks.on_test_begin()
        self._reset_model_metrics(training=False)
        totals = self._run(inp, 0, training=False, steps=steps, hooks=self._hooks(callbacks, 0, training=False))
        logs = self._logs(totals, "test_step")
        callbacks.on_test_end(logs)
        return {prefix + k: v for k, v in logs.items()}

    # ------------------------------------------------------------ public API

    @progress.watched  # the agent's hang watchdog judges silence only inside fit/evaluate
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: Sequence[Any] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: dict[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int = 1,
        seed: int | None = 0,
        checkpoint_dir: str | None = None,
    ) -> Any:
        """Train like ``model.fit``; see `keras_distrib.trainers.fit`. Returns the History."""
        # Each input turned into a source once per fit (a DatasetSource reads its graph).
        source, val_source = fit_sources(x, y, sample_weight, class_weight, validation_split, validation_data)
        verbose = cb_utils.resolve_verbose(verbose)
        repeat = steps_per_epoch is not None
        train = self._prepare(source, batch_size=batch_size, shuffle=shuffle, seed=seed, repeat=repeat, training=True)
        target = steps_per_epoch or train.steps
        if target is None and source.count_unknown_size():
            train = self._prepare(source, batch_size=batch_size, shuffle=shuffle, seed=seed, repeat=repeat,
                                  training=True)
            target = train.steps
        if target is None:
            raise TrainerError(
                "the training data has no end (an infinite dataset: .repeat()) or unknown size, and "
                "steps_per_epoch is not given. HINT: pass steps_per_epoch=..., state the size with "
                "tf.data.experimental.assert_cardinality(N), or give num_examples= to the keras_distrib.data source."
            )
        val = None
        if val_source is not None:
            val = self._prepare(val_source, batch_size=validation_batch_size or batch_size,
                                shuffle=False, seed=None, repeat=False, training=False)

        callbacks = cb_utils.with_history(callbacks)
        tmpdir = None if self.is_chief else tempfile.mkdtemp(prefix="keras_distrib_worker_")
        if tmpdir:
            cb_utils.redirect_writers(callbacks, tmpdir)
        keeper = self._checkpoint_keeper(checkpoint_dir, target)
        self._keeper = keeper
        started, first_stat, outcome = time.perf_counter(), len(self.epoch_stats), "stopped by an error"
        if keeper is not None:
            keeper.checkpointer.callback_state = lambda: cb_utils.callback_state(callbacks)
        try:
            initial_epoch, done_in_epoch = self._resume(keeper, target, initial_epoch, epochs)
            restored = keeper.checkpointer.restored if keeper is not None else None
            if restored is not None and self.is_chief:  # a resume: CSVLogger files continue, not restart
                cb_utils.continue_csv_logs(callbacks, initial_epoch)
            cbs = cb_utils.callback_list(callbacks, self.model, epochs=epochs, steps=target,
                                         verbose=verbose, show=self.is_chief)
            if restored is not None and keeper is not None:
                self._workers_changed(callbacks, restored.workers, keeper.checkpointer.workers)
            with preemption_signals(enabled=keeper is not None):
                history = self._epoch_loop(cbs, train, val, epochs=epochs, initial_epoch=initial_epoch,
                                           steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                                           validation_freq=validation_freq, keeper=keeper,
                                           resume_steps=target - done_in_epoch if done_in_epoch else None,
                                           resume_callbacks=(callbacks, restored.callbacks if restored else None),
                                           report=verbose != 0)
            self._release(train)
            outcome = "stopped early by a callback" if self.model.stop_training else "finished"
            return history
        except Preempted:
            outcome = "preempted (checkpoint saved)"
            raise
        except KeyboardInterrupt:
            outcome = "interrupted"
            raise
        finally:
            if self.is_chief and verbose != 0:
                newest = keeper.checkpointer.store.latest() if keeper is not None else None
                logger.info(summary_line(self.epoch_stats[first_stat:], time.perf_counter() - started, outcome,
                                 keeper.checkpointer.store.directory if keeper is not None else None,
                                 newest[1] if newest else None))
            self._keeper = None
            if keeper is not None:
                keeper.close()
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)

    def _epoch_loop(self, cbs: Any, train: Any, val: Any, *, epochs: int, initial_epoch: int,
                    steps_per_epoch: int | None, validation_steps: int | None, validation_freq: int,
                    keeper: CheckpointKeeper | None, resume_steps: int | None = None,
                    resume_callbacks: tuple[Sequence[Any], Any] = ((), None), report: bool = False) -> Any:
        self.model.stop_training = False
        self._last_epoch = epochs - 1  # nothing to make ready past it
        progress.training_ended(False)
        cbs.on_train_begin()
        cb_utils.restore_callback_state(*resume_callbacks)  # after on_train_begin, which resets it
        logs: dict[str, float] = {}
        for epoch in range(initial_epoch, epochs):
            self._reset_model_metrics(training=True)
            if steps_per_epoch is None and train.steps and cbs.params.get("steps") != train.steps:
                # Steps counted in an earlier epoch (files dealt whole), not the estimate.
                cbs.set_params({**cbs.params, "steps": train.steps})
            cbs.on_epoch_begin(epoch)
            start = time.perf_counter()
            # The epoch a mid-epoch checkpoint resumes runs only its remaining steps.
            steps = resume_steps if epoch == initial_epoch and resume_steps else steps_per_epoch
            train.source.on_epoch_begin(epoch)  # a Keras PyDataset's hooks (Source protocol)
            totals = self._run(train, epoch, training=True, steps=steps,
                               hooks=self._hooks(cbs, epoch, training=True))
            train.source.on_epoch_end(epoch)
            self._after_train_epoch()
            self._share_epoch_state()
            seconds = time.perf_counter() - start
            stats = {"epoch": epoch, "seconds": seconds, "steps": totals.steps,
                     "steps_per_sec": totals.steps / max(seconds, 1e-9),
                     "worker_steps_per_sec": {w: n / max(self.worker_busy.get(w, seconds), 1e-9)
                                              for w, n in sorted(self.worker_steps.items())},
                     "workers_recovered": self.workers_recovered}
            self.epoch_stats.append(stats)
            logs = self._logs(totals)
            if val is not None and (epoch + 1) % max(1, validation_freq) == 0:
                logs.update(self._evaluate(val, cbs, steps=validation_steps, prefix="val_"))
            cbs.on_epoch_end(epoch, logs)
            if report and self.is_chief:  # after Keras' progress bar finished its epoch line
                logger.info(epoch_line(stats, epochs, self.epoch_stats[-2] if epoch > initial_epoch else None))
            # After the callbacks: the checkpoint holds their view of this epoch (best values,
            # a learning rate ReduceLROnPlateau just lowered).
            self._save_checkpoint(keeper, epoch + 1)
            if self._agree(bool(self.model.stop_training)):
                break
        cbs.on_train_end(logs)
        return self.model.history

    @progress.watched
    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        verbose: Any = 0,
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Any] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Every example once (or ``steps`` batches); returns what ``model.evaluate`` returns:
        the loss alone as a scalar, else a list in ``model.metrics_names`` order, or the
        ``{"loss": ..., metric: ...}`` dict with ``return_dict=True``."""
        inp = self._prepare(kd_data.as_source(as_data(x, y, sample_weight), "x"), batch_size=batch_size, shuffle=False,
                            seed=None, repeat=False, training=False)
        cbs = cb_utils.callback_list(callbacks, self.model, epochs=1, steps=steps or inp.steps,
                                     verbose=cb_utils.resolve_verbose(verbose), show=self.is_chief)
        logs = self._evaluate(inp, cbs, steps=steps, prefix="")
        return logs if return_dict else private.flatten_metrics_in_order(self.model, logs)

    def predict(
        self,
        x: Any,
        *,
        batch_size: int | None = None,
        verbose: Any = 0,
        steps: int | None = None,
        callbacks: Sequence[Any] | None = None,
    ) -> Any:
        """Predictions for every row of ``x``, in ``x``'s order (see `keras_distrib.trainers.predict`)."""
        from . import ordered

        source = kd_data.keyed_source(x, batch_size=batch_size or step_contract.DEFAULT_BATCH_SIZE, steps=steps)
        cbs = cb_utils.callback_list(callbacks, self.model, epochs=1, steps=None,
                                     verbose=cb_utils.resolve_verbose(verbose), show=self.is_chief)
        cbs.on_predict_begin()
        batches = 0

        def progress(done: int) -> None:
            nonlocal batches
            for b in range(batches, done):
                cbs.on_predict_batch_begin(b)
                cbs.on_predict_batch_end(b, {})
            batches = done

        parts = self._predict_rows(source, batch_size=batch_size, progress=progress)
        out = ordered.assemble(parts, None if source.batched else source.num_examples)
        cbs.on_predict_end()
        return out

    def _predict_call(self) -> Callable[[Any], Any]:
        """``x -> predictions`` of one batch: the model's own ``predict_step`` when its class
        overrides it (given the ``data`` Keras would give it), else ``model(x, training=False)``."""
        import tensorflow as tf

        model = self.model
        if "predict_step" in self.custom_steps:
            # Traced as the Python it is, as Keras traces the steps (no AutoGraph).
            return tf.autograph.experimental.do_not_convert(lambda x: model.predict_step(step_contract.step_data(x)))
        return lambda x: model(x, training=False)

    def _predict_rows(self, source: Any, *, batch_size: int | None,
                      progress: Callable[[int], None]) -> list[tuple[Any, Any]]:  # pragma: no cover - abstract
        """``(keys, predictions)`` parts covering every element of the keyed ``source``."""
        raise NotImplementedError

    def checkpoint(self) -> Any:
        """A tf.train.Checkpoint of model, optimizer and the exact step."""
        import tensorflow as tf

        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.global_step)


def epoch_line(stats: dict[str, Any], epochs: int, previous: dict[str, Any] | None = None) -> str:
    """``epoch 2/5: 3.1 s, 45.2 steps/s (worker 0: 24.0, worker 1: 21.2 steps/s)``.

    ``previous``: the epoch before in this fit, to name stragglers (stragglers.py).
    """
    line = f"epoch {stats['epoch'] + 1}/{epochs}: {stats['seconds']:.1f} s, {stats['steps_per_sec']:.1f} steps/s"
    workers = stats.get("worker_steps_per_sec") or {}
    if workers:
        line += " (" + ", ".join(f"worker {w}: {r:.1f}" for w, r in workers.items()) + " steps/s)"
    return line + straggler_note(stats, previous)


def summary_line(stats: Sequence[dict[str, Any]], seconds: float, outcome: str, checkpoint_dir: Any,
                 newest: Meta | None = None) -> str:
    """The one line fit() ends with: time, epochs trained, why it ended, where checkpoints went.

    When fit did not finish, ``newest`` (the newest complete checkpoint) says where a rerun
    resumes: the work after it, counted in "trained", is redone.
    """
    if stats:
        first, last = stats[0]["epoch"] + 1, stats[-1]["epoch"] + 1
        epochs = f"epoch {first}" if first == last else f"epochs {first}-{last}"
        trained = f"trained {epochs} ({sum(s['steps'] for s in stats)} steps)"
    else:
        trained = "trained no epoch"
    where = f"checkpoints in {checkpoint_dir}" if checkpoint_dir else "no checkpoint_dir"
    if checkpoint_dir and outcome not in ("finished", "stopped early by a callback"):
        where += (f", the newest at step {newest.step} ({where_in_training(newest)}): a rerun resumes there"
                  if newest is not None else ", none written yet: a rerun starts over")
    return f"fit {outcome}: {trained} in {seconds:.1f} s; {where}."
