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

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import _private_apis as private

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
    """The model's compiled metrics, used statelessly (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.metric = private.compiled_metrics(model)

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
