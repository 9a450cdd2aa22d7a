"""Logic shared by the parameter-server and all-reduce trainers.

Metrics: Keras 3 metric variables are updated with read-modify-write, which loses
updates when several workers write them concurrently. Instead every scheduled function
starts from the metrics' reset state, advances it with ``Metric.stateless_update_state``
(no variable is touched) and returns the resulting state tensors. The chief adds
``state - reset_state`` of every closure into a NumPy accumulator and computes results with
``stateless_result``. This is exact for metrics whose state is a sum (Mean, accuracy
wrappers, Precision/Recall/AUC confusion counts...), i.e. all of Keras' built-in
compiled metrics except stateful extrema.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

RUN_HINT = (
    "Run the script under `python -m keras_distrib.local --nodes 2 SCRIPT` (one machine) "
    "or `srun` via the keras-distrib launcher, and build the model inside "
    "`with keras_distrib.strategy().scope():`."
)


class TrainerError(RuntimeError):
    """The trainer cannot run in this process/layout; the message ends with a HINT."""


def _kind(strategy: Any) -> str | None:
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return "ps"
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "allreduce"
    return None


def strategy_kind(strategy: Any) -> str | None:
    """"ps", "allreduce" or None for a strategy object."""
    return _kind(strategy)


def resolve_strategy(strategy: Any = None, allow: Sequence[str] = ("ps", "allreduce")) -> Any:
    """The explicit ``strategy`` or the one whose scope is active; raise TrainerError else."""
    import tensorflow as tf

    if strategy is None:
        strategy = tf.distribute.get_strategy()
        if _kind(strategy) is None and "TF_CONFIG" in os.environ:
            # In a job, outside any scope: the job's strategy (created once per process).
            from ..strategies import strategy as job_strategy

            strategy = job_strategy()
    kind = _kind(strategy)
    if kind is None:
        layout = os.environ.get("KERAS_DISTRIB_LAYOUT")
        where = (
            f"KERAS_DISTRIB_LAYOUT={layout!r} is set but no distribution strategy is active"
            if layout
            else "this process is not part of a keras_distrib job (no TF_CONFIG / strategy)"
        )
        raise TrainerError(
            f"keras_distrib training needs a ParameterServerStrategy or "
            f"MultiWorkerMirroredStrategy, got {type(strategy).__name__}: {where}. "
            f"HINT: {RUN_HINT} Or pass strategy= explicitly."
        )
    if kind not in allow:
        raise TrainerError(
            f"this trainer serves the {'/'.join(allow)} layout(s) but the strategy is "
            f"{type(strategy).__name__} ({kind}). HINT: use keras_distrib.fit(), which picks "
            "the trainer matching the layout, or launch with the matching --layout."
        )
    return strategy


def check_model(model: Any, strategy: Any) -> Any:
    """Validate that ``model`` is built and compiled for ``strategy``; return its optimizer."""
    if not getattr(model, "built", False) or not model.variables:
        raise TrainerError(
            "the model has no variables yet. HINT: give it an `keras.Input(...)` (or call "
            "`model.build(input_shape)`) inside `with strategy.scope():` before fit()."
        )
    opt = getattr(model, "optimizer", None)
    if opt is None or getattr(model, "_compile_loss", None) is None and not _overrides_loss(model):
        raise TrainerError(
            "the model is not compiled with an optimizer and a loss. HINT: call "
            "`model.compile(optimizer=..., loss=..., metrics=[...])` inside the strategy scope."
        )
    opt_strategy = getattr(opt, "_distribution_strategy", None)
    if opt_strategy is not None and opt_strategy is not strategy:
        raise TrainerError(
            "the optimizer was created outside the distribution strategy scope (TensorFlow "
            "then mixes two strategies when applying gradients). HINT: create the optimizer "
            "and call `model.compile(...)` inside `with strategy.scope():`."
        )
    model_var = model.trainable_variables[0] if model.trainable_variables else None
    if model_var is not None and _kind(strategy) == "ps" and "/job:ps" not in _device(model_var):
        raise TrainerError(
            "the model's variables are not on the parameter servers (device "
            f"{_device(model_var)!r}). HINT: build the model inside `with strategy.scope():` "
            "or with keras_distrib.trainers.placement.build(model_fn, strategy)."
        )
    return opt


def _overrides_loss(model: Any) -> bool:
    import keras

    return type(model).compute_loss is not keras.Model.compute_loss


def _device(v: Any) -> str:
    return getattr(getattr(v, "value", v), "device", "") or ""


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a batch, Keras' convention."""
    if isinstance(batch, (list, tuple)):
        batch = tuple(batch) + (None,) * (3 - len(batch))
        return batch[0], batch[1], batch[2]
    return batch, None, None


def batch_size_of(x: Any) -> Any:
    import tensorflow as tf

    return tf.shape(tf.nest.flatten(x)[0])[0]


# ---------------------------------------------------------------- metrics


class MetricSet:
    """The model's compiled metrics, used statelessly (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.metric = getattr(model, "_compile_metrics", None)
        self.names: list[str] = []

    def build(self, model: Any, sample_batch: Any) -> None:
        """Create the compiled metrics' variables from one sample batch (on this process)."""
        if self.metric is None or self.metric.built:
            return
        x, y, _ = unpack(sample_batch)
        if y is None:
            self.metric = None
            return
        y_pred = model(x, training=False)
        self.metric.build(y, y_pred)

    @property
    def active(self) -> bool:
        return self.metric is not None and bool(self.metric.variables)

    def initial_state(self) -> list[Any]:
        """Reset-state tensors (call inside the traced function)."""
        return list(self.metric.stateless_reset_state()) if self.active else []

    def update(self, state: list[Any], y: Any, y_pred: Any, sample_weight: Any) -> list[Any]:
        if not self.active:
            return state
        return list(self.metric.stateless_update_state(state, y, y_pred, sample_weight=sample_weight))

    def reset_numpy(self) -> list[np.ndarray]:
        if not self.active:
            return []
        return [np.asarray(t) for t in self.metric.stateless_reset_state()]

    def results(self, state: list[np.ndarray]) -> dict[str, float]:
        if not self.active:
            return {}
        res = self.metric.stateless_result([np.asarray(s) for s in state])
        if not isinstance(res, dict):
            res = {self.metric.name: res}
        return {k: float(np.asarray(v)) for k, v in res.items()}


@dataclass
class Totals:
    """Sums over executed steps, accumulated on the chief in NumPy."""

    reset: list[np.ndarray]
    loss_sum: float = 0.0
    count: float = 0.0
    steps: int = 0
    state: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = [r.copy() for r in self.reset]

    def add(self, out: dict[str, Any]) -> None:
        """Add one closure/function result {"loss_sum", "count", "steps", "state"}."""
        self.loss_sum += float(np.asarray(out["loss_sum"]))
        self.count += float(np.asarray(out["count"]))
        self.steps += int(np.asarray(out["steps"]))
        for i, s in enumerate(out["state"]):
            self.state[i] = self.state[i] + (np.asarray(s) - self.reset[i])

    def merge(self, other: "Totals") -> None:
        """Add another accumulator that started from the same reset state."""
        self.loss_sum += other.loss_sum
        self.count += other.count
        self.steps += other.steps
        self.state = [a + (b - r) for a, b, r in zip(self.state, other.state, self.reset)]

    def logs(self, metrics: MetricSet, prefix: str = "") -> dict[str, float]:
        logs = {"loss": self.loss_sum / self.count if self.count else float("nan")}
        logs.update(metrics.results(self.state))
        return {prefix + k: v for k, v in logs.items()}


def zeros_totals(metrics: MetricSet) -> dict[str, Any]:
    """The traced-function accumulator start value (inside a tf.function)."""
    import tensorflow as tf

    return {
        "loss_sum": tf.constant(0.0, tf.float32),
        "count": tf.constant(0.0, tf.float32),
        "steps": tf.constant(0, tf.int64),
        "state": metrics.initial_state(),
    }


def step_totals(totals: dict[str, Any], loss: Any, n: Any, state: list[Any]) -> dict[str, Any]:
    """Fold one step's mean ``loss`` over ``n`` examples into ``totals`` (traced)."""
    import tensorflow as tf

    n = tf.cast(n, tf.float32)
    return {
        "loss_sum": totals["loss_sum"] + tf.cast(loss, tf.float32) * n,
        "count": totals["count"] + n,
        "steps": totals["steps"] + 1,
        "state": state,
    }


def batch_reporter(cbs: Any, progress: "Progress", metrics: MetricSet) -> Callable[[int, "Totals"], None]:
    """Per-closure hook: batch callbacks with running logs, then the progress bar."""

    def on_chunk(last: int, totals: Totals) -> None:
        logs = totals.logs(metrics)
        cbs.on_train_batch_begin(last)
        cbs.on_train_batch_end(last, logs)
        progress.update(last + 1, logs)

    return on_chunk


def epoch_saver(keeper: "CheckpointKeeper | None", step: Any) -> Callable[[int], None]:
    """Epoch-end hook saving a checkpoint at the exact step (a no-op without a keeper)."""

    def on_epoch_done(epoch: int) -> None:
        if keeper is not None:
            keeper.save(int(step.numpy()))

    return on_epoch_done


def mean_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
    """The compiled loss (mean over the batch) plus regularisation losses."""
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


# ---------------------------------------------------------------- the epoch loop


@dataclass
class Progress:
    """Keras progress bar plus steps/s, shown on the chief only."""

    target: int | None
    verbose: int
    _bar: Any = None
    _t0: float = 0.0
    rate: float = 0.0

    def start(self) -> None:
        import keras

        self._t0 = time.perf_counter()
        if self.verbose == 1:
            self._bar = keras.utils.Progbar(self.target, stateful_metrics=["loss", "steps/s"])

    def _rate(self, step: int) -> float:
        return step / max(time.perf_counter() - self._t0, 1e-9)

    def update(self, step: int, logs: dict[str, float]) -> None:
        # The last step is drawn by finish(), with validation results.
        if self._bar is not None and step != self.target:
            self._bar.update(step, values=list(logs.items()) + [("steps/s", self._rate(step))])

    def stop_clock(self, step: int) -> float:
        """Training steps/s of the epoch (before validation)."""
        self.rate = self._rate(step)
        return self.rate

    def finish(self, step: int, logs: dict[str, float], epoch: int, epochs: int) -> None:
        if self._bar is not None:
            self._bar.update(step, values=list(logs.items()) + [("steps/s", self.rate)], finalize=True)
        elif self.verbose == 2:
            items = " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())
            print(f"Epoch {epoch + 1}/{epochs} - {step} steps - {self.rate:.1f} steps/s - {items}", flush=True)


def epoch_steps(num_examples: int | None, batch_size: int | None, steps: int | None, what: str) -> int | None:
    """Steps per epoch: explicit, or enough batches to see every example once."""
    if steps is not None:
        return int(steps)
    if num_examples is None:
        return None
    if batch_size is None:  # already-batched data: num_examples counts batches
        return max(1, int(num_examples))
    return max(1, math.ceil(num_examples / batch_size))


def make_callbacks(callbacks: Sequence[Any] | None, model: Any, epochs: int, steps: int | None, verbose: int) -> Any:
    import keras

    return keras.callbacks.CallbackList(
        list(callbacks or []), add_history=True, add_progbar=False, model=model,
        epochs=epochs, steps=steps, verbose=verbose,
    )


class CheckpointKeeper:
    """tf.train.Checkpoint(model, optimizer, step), saved and restored through
    `keras_distrib.checkpoints.Checkpointer` (atomic, newest complete one, metadata).

    Non-chief writers (all-reduce workers > 0) must still take part in saving, so they
    write to a throw-away temporary directory.
    """

    def __init__(self, directory: str, model: Any, optimizer: Any, step: Any, *, is_chief: bool, max_to_keep: int = 3) -> None:
        import tensorflow as tf

        from ..checkpoints import Checkpointer

        self.is_chief = is_chief
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
        self.checkpointer = Checkpointer(directory, self.checkpoint, model, writer=is_chief, keep=max_to_keep)

    def restore(self) -> bool:
        """Restore the newest complete checkpoint of ``directory`` (all workers read the chief's)."""
        return self.checkpointer.restore() is not None

    def save(self, step: int) -> None:
        self.checkpointer.save(step)

    def close(self) -> None:
        pass


def redirect_writers(callbacks: Sequence[Any], tmpdir: str) -> None:
    """Point file-writing callbacks of a non-chief worker into ``tmpdir``."""
    import keras

    for i, cb in enumerate(callbacks):
        sub = os.path.join(tmpdir, f"cb{i}")
        if isinstance(cb, keras.callbacks.ModelCheckpoint):
            cb.filepath = os.path.join(sub, os.path.basename(str(cb.filepath)))
        elif isinstance(cb, keras.callbacks.CSVLogger):
            cb.filename = os.path.join(sub, os.path.basename(str(cb.filename)))
        elif isinstance(cb, keras.callbacks.TensorBoard):
            cb.log_dir = sub
            for attr in ("_log_write_dir", "_train_dir", "_val_dir"):
                if hasattr(cb, attr):
                    setattr(cb, attr, os.path.join(sub, os.path.basename(str(getattr(cb, attr)))))
        elif isinstance(cb, keras.callbacks.BackupAndRestore):
            cb.backup_dir = sub
        else:
            continue
        os.makedirs(sub, exist_ok=True)


def run_epochs(
    *,
    model: Any,
    epochs: int,
    initial_epoch: int,
    steps_per_epoch: int | None,
    callbacks: Any,
    verbose: int,
    show: bool,
    train_epoch: Callable[[int, Progress, Any], "Totals"],
    validate: Callable[[], dict[str, float]] | None,
    train_logs: Callable[["Totals"], dict[str, float]],
    on_epoch_done: Callable[[int], None],
) -> Any:
    """The fit() epoch loop shared by both trainers; returns the History."""
    model.stop_training = False
    callbacks.on_train_begin()
    logs: dict[str, float] = {}
    for epoch in range(initial_epoch, epochs):
        callbacks.on_epoch_begin(epoch)
        progress = Progress(steps_per_epoch, verbose if show else 0)
        if show and verbose == 1:
            print(f"Epoch {epoch + 1}/{epochs}", flush=True)
        progress.start()
        totals = train_epoch(epoch, progress, callbacks)
        model._keras_distrib_steps_per_sec = progress.stop_clock(totals.steps)
        logs = train_logs(totals)
        if validate is not None:
            logs.update(validate())
        progress.finish(totals.steps, logs, epoch, epochs)
        on_epoch_done(epoch)
        callbacks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs)
    return model.history
