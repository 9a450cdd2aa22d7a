"""Compiled metrics used statelessly, and the loss/count/metric sums of executed steps.

Keras 3 metric variables are updated with read-modify-write, which loses updates when
several workers write them concurrently. Instead every scheduled function starts from the
metrics' reset state, advances it with ``Metric.stateless_update_state`` (no variable is
touched) and returns the resulting state tensors. The chief (or every all-reduce worker,
after one all-reduce) adds ``state - reset_state`` of every function result into a NumPy
accumulator and computes results with ``stateless_result``. This is exact for metrics whose
state is a sum (Mean, accuracy wrappers, Precision/Recall/AUC confusion counts...), i.e. all
of Keras' built-in compiled metrics except stateful extrema.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import _private_apis as private

logger = logging.getLogger(__name__)

#: Sums kept per scheduled function besides the metric states, in this order.
SCALARS = ("loss_sum", "count", "steps", "finite")


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a batch: Keras' own convention."""
    import keras

    if isinstance(batch, dict) or not isinstance(batch, (list, tuple)):
        return batch, None, None
    return keras.utils.unpack_x_y_sample_weight(tuple(batch))


def batch_size_of(x: Any) -> Any:
    import tensorflow as tf

    return tf.shape(tf.nest.flatten(x)[0])[0]


class MetricSet:
    """The model's compiled metrics and its per-output loss trackers, used statelessly (see
    the module docstring).

    The state is one list: the compiled metrics' variables, then the (total, count) of each
    per-output loss tracker (the ``Mean`` that Keras' ``CompileLoss`` keeps per output of a
    multi-output model: its ``<output>_loss`` logs). The trackers are updated by ``model.compute_loss``
    itself, so a step runs it inside a ``StatelessScope`` holding `loss_mapping` and hands
    the scope to `update`.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.metric = private.compiled_metrics(model)

    def build(self, model: Any, sample_batch: Any) -> None:
        """Create the compiled metrics' and loss trackers' variables from one sample batch (on this process)."""
        if not self.needs_build:
            return
        x, y, sample_weight = unpack(sample_batch)
        if y is None:
            self.metric = None
            return
        import keras

        compiled_loss = private.compiled_loss(model)
        y_pred = model(x, training=False)
        # One update and one loss, in a scope that changes no variable, as Keras'
        # ``_symbolic_build``: metrics such as F1Score and R2Score create their state on their
        # first update, and CompileLoss its per-output trackers on its first call.
        with keras.StatelessScope():
            if self.metric is not None and not self.metric.built:
                self.metric.build(y, y_pred)
                self.metric.update_state(y, y_pred, sample_weight=sample_weight)
            if compiled_loss is not None and not compiled_loss.built:
                try:
                    compiled_loss(y, y_pred, sample_weight)
                except Exception:  # noqa: BLE001 - a model whose own steps or compute_loss shape y
                    logger.debug("the compiled loss does not take the input's targets: no per-output loss logs")

    @property
    def loss_trackers(self) -> list[Any]:
        """The per-output loss trackers of Keras' ``CompileLoss`` (none for one output, or before `build`)."""
        return list(getattr(private.compiled_loss(self.model), "metrics", None) or [])

    @property
    def needs_build(self) -> bool:
        """True until `build` has created the compiled metrics' and loss trackers' variables."""
        compiled_loss = private.compiled_loss(self.model)
        return (self.metric is not None and not self.metric.built) or (compiled_loss is not None and not compiled_loss.built)

    @property
    def active(self) -> bool:
        return bool(self._compiled_variables or self.loss_trackers)

    @property
    def _compiled_variables(self) -> list[Any]:
        return list(self.metric.variables) if self.metric is not None else []

    def _split(self, state: list[Any]) -> tuple[list[Any], list[Any]]:
        k = len(self._compiled_variables)
        return list(state[:k]), list(state[k:])

    def initial_state(self) -> list[Any]:
        """Reset-state tensors (call inside the traced function)."""
        import keras

        compiled = list(self.metric.stateless_reset_state()) if self._compiled_variables else []
        zeros = [keras.ops.zeros((), v.dtype) for tracker in self.loss_trackers for v in (tracker.total, tracker.count)]
        return compiled + zeros

    def loss_mapping(self, state: list[Any]) -> list[tuple[Any, Any]]:
        """The loss trackers' variables mapped to their part of ``state``: for the
        ``StatelessScope`` that ``model.compute_loss`` runs in (empty: no trackers)."""
        _, tracked = self._split(state)
        variables = [v for tracker in self.loss_trackers for v in (tracker.total, tracker.count)]
        return list(zip(variables, tracked))

    def loss_scope(self, state: list[Any]) -> Any:
        """A ``StatelessScope`` of `loss_mapping` for ``model.compute_loss`` (a null context
        when there are no trackers: a model's own ``compute_loss`` then writes as in Keras)."""
        import contextlib

        import keras

        mapping = self.loss_mapping(state)
        return keras.StatelessScope(state_mapping=mapping) if mapping else contextlib.nullcontext()

    def update(self, state: list[Any], y: Any, y_pred: Any, sample_weight: Any, *,
               loss_scope: Any = None, rows: Any = None, examples: Any = None) -> list[Any]:
        """``state`` advanced by one step: the compiled metrics on ``(y, y_pred, sample_weight)``,
        the loss trackers from what ``compute_loss`` left in ``loss_scope`` (see `_tracked`)."""
        compiled, tracked = self._split(state)
        if self._compiled_variables:
            compiled = list(self.metric.stateless_update_state(compiled, y, y_pred, sample_weight=sample_weight))
        if self.loss_trackers and loss_scope is not None:
            tracked = self._tracked(tracked, loss_scope, rows, examples)
        return compiled + tracked

    def _tracked(self, tracked: list[Any], scope: Any, rows: Any, examples: Any) -> list[Any]:
        """Each loss tracker's (total, count) after one step: its loss (a mean over the
        step's ``rows``, padding rows weighing 0) times ``rows``, over ``examples`` (the
        real ones). Keras weighs the step by the batch's static size, or by 1 when that size
        is unknown, as in a traced step: the mean over the examples does not depend on how
        they were batched."""
        import keras

        out = []
        for i, tracker in enumerate(self.loss_trackers):
            total, count = tracked[2 * i], tracked[2 * i + 1]
            new_total, new_count = scope.get_current_value(tracker.total), scope.get_current_value(tracker.count)
            if new_total is None or new_count is None:
                out += [total, count]
                continue
            loss = keras.ops.divide_no_nan(new_total - total, new_count - count)
            out += [total + loss * keras.ops.cast(rows, total.dtype), count + keras.ops.cast(examples, count.dtype)]
        return out

    def reset_numpy(self) -> list[np.ndarray]:
        return [np.asarray(t) for t in self.initial_state()] if self.active else []

    def results(self, state: list[np.ndarray]) -> dict[str, Any]:
        """The compiled metrics' and loss trackers' results on ``state``, flattened as Keras'
        logs (scalars as floats)."""
        if not self.active:
            return {}
        compiled, tracked = self._split([np.asarray(s) for s in state])
        logs: dict[str, Any] = {}
        if self._compiled_variables:
            res = result_values(self.metric, compiled)
            logs.update(pythonify_logs(res if isinstance(res, dict) else {self.metric.name: res}))
        for i, tracker in enumerate(self.loss_trackers):
            total, count = tracked[2 * i], tracked[2 * i + 1]
            logs[tracker.name] = float(total / count) if count else 0.0
        return logs


def result_values(metric: Any, state: Sequence[Any]) -> Any:
    """``metric.result()`` computed on ``state`` (one value per ``metric.variables``), as NumPy
    values in the structure ``result()`` returns.

    Keras' ``stateless_result`` returns what ``result()`` returns, read after its stateless
    scope has closed: a metric whose ``result()`` returns its variable (``return self.n``, as
    many users write it) would then give the variable, whose own value is the reset one. The
    values are read here inside the scope, as Keras' ``get_metrics_result`` reads them from
    the live variables.
    """
    import keras

    def value(v: Any) -> np.ndarray:
        return np.asarray(keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(v)))

    with keras.StatelessScope(state_mapping=list(zip(metric.variables, state))):
        return keras.tree.map_structure(value, metric.result())


def pythonify_logs(logs: Any) -> dict[str, Any]:
    """A step's returned logs as callbacks get them in Keras (``pythonify_logs``): nested
    dicts flattened (``{"compile_metrics": {"mae": ..}}`` -> ``{"mae": ..}``), scalars as floats."""
    import numpy as np

    if not isinstance(logs, dict):
        logs = {"output": logs}
    out: dict[str, Any] = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            out.update(pythonify_logs(value))
        else:
            a = np.asarray(value)
            out[key] = float(a) if a.ndim == 0 and a.dtype.kind in "fiub" else a
    return out


@dataclass
class Totals:
    """Sums over executed steps, accumulated in NumPy (chief / every all-reduce worker)."""

    reset: list[np.ndarray]
    loss_sum: float = 0.0
    count: float = 0.0
    steps: int = 0
    finite: bool = True
    state: list[np.ndarray] = field(default_factory=list)
    #: What the model's own train_step/test_step returned at the last step folded in
    #: (None with the trainers' default steps).
    last: Any = None

    def __post_init__(self) -> None:
        self.state = [r.copy() for r in self.reset]

    def add(self, out: dict[str, Any]) -> None:
        """Add one function result (see `unpack_totals`)."""
        self.loss_sum += float(out["loss_sum"])
        self.count += float(out["count"])
        self.steps += int(out["steps"])
        self.finite = self.finite and bool(out["finite"]) and np.isfinite(float(out["loss_sum"]))
        for i, s in enumerate(out["state"]):
            self.state[i] = self.state[i] + (np.asarray(s) - self.reset[i])
        if out.get("logs") is not None and int(out["steps"]):
            self.last = out["logs"]

    def logs(self, metrics: MetricSet, prefix: str = "") -> dict[str, float]:
        if self.last is not None:  # the model's own step: its last logs, as Keras reports them
            return {prefix + k: v for k, v in pythonify_logs(self.last).items()}
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
        "finite": tf.constant(True),
        "state": metrics.initial_state(),
    }


def step_totals(totals: dict[str, Any], loss: Any, n: Any, state: list[Any], finite: Any = True) -> dict[str, Any]:
    """Fold one step's mean ``loss`` over ``n`` examples into ``totals`` (traced)."""
    import tensorflow as tf

    n = tf.cast(n, tf.float32)
    return {
        "loss_sum": totals["loss_sum"] + tf.cast(loss, tf.float32) * n,
        "count": totals["count"] + n,
        "steps": totals["steps"] + 1,
        "finite": tf.logical_and(totals["finite"], finite),
        "state": state,
    }


def all_finite(tensors: Sequence[Any]) -> Any:
    """True if every element of ``tensors`` is finite (traced; cheap next to a step)."""
    import tensorflow as tf

    checks = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors if t is not None and t.dtype.is_floating]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def pack_totals(totals: dict[str, Any]) -> Any:
    """A function's totals as one float64 vector (traced): ``[*SCALARS, *state]``.

    Fetching a closure's result costs the chief one remote copy per tensor, so the whole
    result travels as one tensor. float64 holds float32 sums and integer counts exactly.
    """
    import tensorflow as tf

    parts = [totals[k] for k in SCALARS] + list(totals["state"])
    return tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in parts], axis=0)


def unpack_totals(vector: Any, reset: Sequence[np.ndarray]) -> dict[str, Any]:
    """Inverse of `pack_totals`; metric states get their reset shapes/dtypes."""
    vector = np.asarray(vector)
    out: dict[str, Any] = dict(zip(SCALARS, vector[: len(SCALARS)]))
    state, i = [], len(SCALARS)
    for r in reset:
        state.append(vector[i:i + r.size].reshape(r.shape).astype(r.dtype))
        i += r.size
    out["state"] = state
    return out
