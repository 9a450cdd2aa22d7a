"""Keras' metric and loss contract at fixed weights, as a user script (tests/local/test_metric_contract.py).

Run plainly (``python metric_contract_script.py``: plain single-process Keras, ``model.fit``
itself) it gives the reference; run by a layout (TF_CONFIG set by the launcher or the test
cluster) it trains with ``keras_distrib.fit``/``evaluate``/``predict``; on the jax layouts
with plain ``model.fit`` under ``keras_distrib.distribution()``. The learning rate is 0 and
the weights are set from a seeded generator, so every run sees the same model and the
metrics of ``fit`` equal those of ``evaluate`` on the training data.

Three models:

* ``metrics``: four heads (binary, categorical, sparse, regression); every metric class of
  ``keras.metrics`` on the first head it applies to (`head_for`: updated once on the task's
  targets; those that are not sums over examples are listed, not compared), plus the
  custom metrics of Keras' guides (a
  result returned as its variable, as a ratio, as a dict; with and without ``sample_weight``),
  trained with ``sample_weight``;
* ``losses``: one head per loss class of ``keras.losses`` (on the first task it applies to, `tasks_for`),
  a loss function and a ``Loss`` subclass, with ``loss_weights`` and ``sample_weight``;
* ``class_weight``: one softmax output, a loss function, ``class_weight``.

Prints one JSON line: per model, the History, ``evaluate`` as a list and as a dict, the
``logs`` the callbacks received at the last batch and epoch ends, and ``predict``'s values.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from typing import Any, Callable

import numpy as np

import keras

LAYOUT = os.environ.get("KERAS_DISTRIB_LAYOUT", "")  # set by the launcher; empty: plain Keras
ON_JAX = LAYOUT.startswith("jax")
# Sizes that no batch divides. On the jax layouts every batch must divide by the process
# count (2 or 3), or Keras' DataParallel leaves the remainder out (docs/jax.md): 132 = 4 x 30
# + 12. Elsewhere no worker count divides them either (uneven shards).
# METRIC_CONTRACT_SIZES=jax: the jax layouts' sizes on plain Keras (their reference).
JAX_GRID = ON_JAX or os.environ.get("METRIC_CONTRACT_SIZES") == "jax"
N, VAL, BATCH = (132, 66, 30) if JAX_GRID else (131, 67, 16)
D, CLASSES = 5, 4
TASKS = ("binary", "categorical", "sparse", "regression")


def task_data(n: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """Inputs, the targets of every task and a sample weight."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    labels = rng.integers(0, CLASSES, size=n)
    y = {
        "binary": (rng.random((n, 1)) < 0.4).astype("float32"),
        "categorical": np.eye(CLASSES, dtype="float32")[labels],
        "sparse": labels.reshape(n, 1).astype("int32"),
        "regression": rng.uniform(0.1, 2.0, size=(n, 1)).astype("float32"),
    }
    return x, y, rng.uniform(0.2, 2.0, size=n).astype("float32")


def task_predictions(n: int) -> dict[str, np.ndarray]:
    """Predictions shaped like each head's output, to try a metric or loss on a task."""
    rng = np.random.default_rng(7)
    soft = rng.random((n, CLASSES)).astype("float32") + 0.1
    return {"binary": rng.uniform(0.05, 0.95, size=(n, 1)).astype("float32"),
            "categorical": soft / soft.sum(axis=1, keepdims=True),
            "sparse": soft / soft.sum(axis=1, keepdims=True),
            "regression": rng.uniform(0.1, 2.0, size=(n, 1)).astype("float32")}


ACTIVATION = {"binary": "sigmoid", "categorical": "softmax", "sparse": "softmax", "regression": "softplus"}
UNITS = {"binary": 1, "categorical": CLASSES, "sparse": CLASSES, "regression": 1}

#: Values for the constructor parameters that have no default, by name (Keras' own names).
REQUIRED_ARGS = {"num_classes": CLASSES, "target_class_ids": [0, 1], "recall": 0.5, "precision": 0.5,
                 "specificity": 0.5, "sensitivity": 0.5}


def constructed(cls: type, task: str) -> Any:
    """``cls()`` with `REQUIRED_ARGS` for its parameters without defaults (None: one is unknown)."""
    kwargs = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if name not in REQUIRED_ARGS:
            return None
        kwargs[name] = 2 if (name == "num_classes" and task == "binary") else REQUIRED_ARGS[name]
    return cls(**kwargs)


def public_classes(module: Any, base: type) -> list[type]:
    """Every class ``module`` exports that subclasses ``base`` (base itself aside), by name."""
    return [obj for name, obj in sorted(vars(module).items())
            if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not name.startswith("_")]


#: Words in a class name that name the task it is for, in order (the first match wins; a
#: class named by none tries the tasks in `TASKS` order).
NAMED_TASKS = (("Sparse", "sparse"), ("Categorical", "categorical"), ("Categorical", "sparse"),
               ("TopK", "categorical"), ("OneHot", "categorical"), ("Binary", "binary"),
               ("Error", "regression"), ("R2", "regression"), ("Correlation", "regression"),
               ("Poisson", "regression"), ("LogCosh", "regression"), ("Cosine", "regression"),
               ("Huber", "regression"), ("KLDivergence", "regression"))


def tasks_for(cls: type) -> list[str]:
    """The tasks to try a metric or loss class on, those its name names first (a categorical
    loss on the one-unit binary head is finite but meaningless, and some have NaN gradients
    there)."""
    named = [t for key, t in NAMED_TASKS if key in cls.__name__]
    return list(dict.fromkeys(named + list(TASKS)))


@functools.cache
def head_for(cls: type, call: Callable[[Any, Any, Any, Any], Any]) -> tuple[str | None, bool]:
    """The first task of `tasks_for` that ``cls`` applies to (None: none), and whether it is
    `additive` there."""
    task = next((t for t in tasks_for(cls) if applicable(lambda t=t: constructed(cls, t), t, call)), None)
    return task, task is not None and additive(lambda: constructed(cls, task), task, call)


def additive(make: Callable[[], Any], task: str, call: Callable[[Any, Any, Any, Any], Any]) -> bool:
    """True if the value over 12 examples is the same whether they come as one batch or as
    two (a metric's state summed over both updates; a loss's mean over the halves). The
    split puts the smallest labels first: Keras' hinge metrics turn labels 0/1 into -1/1
    only when a whole batch is 0/1, so they depend on how a run batches its data, as do
    Circle, Dice and Tversky, which couple the examples of a batch (docs/keras-contract.md)."""
    _, y, sw = task_data(12, 3)
    order = np.argsort(y["sparse"][:, 0], kind="stable")
    y_true, y_pred, sw = y[task][order], task_predictions(12)[task][order], sw[order]
    one = make()
    whole = np.asarray(call(one, y_true, y_pred, sw), dtype="float64")
    two = make()
    if isinstance(two, keras.metrics.Metric):
        call(two, y_true[:6], y_pred[:6], sw[:6])
        parts = np.asarray(call(two, y_true[6:], y_pred[6:], sw[6:]), dtype="float64")
    else:
        parts = (np.asarray(call(two, y_true[:6], y_pred[:6], sw[:6]), dtype="float64")
                 + np.asarray(call(two, y_true[6:], y_pred[6:], sw[6:]), dtype="float64")) / 2
    return bool(np.allclose(whole, parts, rtol=1e-5, atol=1e-6))


def applicable(make: Callable[[], Any], task: str, call: Callable[[Any, Any, Any, Any], Any]) -> bool:
    """True if a metric or loss made by ``make`` takes the task's targets, predictions and a
    ``sample_weight`` as compiled metrics and losses are called, and gives a finite value
    (eagerly, on this process)."""
    _, y, sw = task_data(12, 3)
    try:
        obj = make()
        if obj is None:
            return False
        value = call(obj, y[task], task_predictions(12)[task], sw)
        return all(np.isfinite(np.asarray(v)).all() for v in keras.tree.flatten(value))
    except Exception:  # noqa: BLE001 - not for this task: that is what is asked
        return False


def metric_value(metric: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> Any:
    metric.update_state(y_true, y_pred, sample_weight=sample_weight)
    return metric.result()


class CountAsVariable(keras.metrics.Metric):
    """Examples seen; ``result()`` returns the variable itself, as users often write it."""

    def __init__(self, name: str = "count_as_variable", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.n = self.add_variable(shape=(), initializer="zeros", name="n")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        self.n.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

    def result(self) -> Any:
        return self.n


class CategoricalTruePositives(keras.metrics.Metric):
    """Keras' guide "Training & evaluation with the built-in methods", as written there:
    weighted, and ``result()`` returns the variable."""

    def __init__(self, name: str = "categorical_true_positives", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = keras.ops.reshape(keras.ops.argmax(y_pred, axis=1), (-1, 1))
        values = keras.ops.cast(keras.ops.cast(y_true, "int32") == keras.ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = keras.ops.multiply(values, keras.ops.reshape(keras.ops.cast(sample_weight, "float32"), (-1, 1)))
        self.true_positives.assign_add(keras.ops.sum(values))

    def result(self) -> Any:
        return self.true_positives


class WeightedMeanError(keras.metrics.Metric):
    """A ratio of two variables, weighted by ``sample_weight``."""

    def __init__(self, name: str = "weighted_mean_error", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.weight = self.add_variable(shape=(), initializer="zeros", name="weight")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        error = keras.ops.mean(keras.ops.abs(keras.ops.cast(y_true, "float32") - y_pred), axis=-1)
        w = keras.ops.ones_like(error) if sample_weight is None else keras.ops.reshape(
            keras.ops.cast(sample_weight, "float32"), keras.ops.shape(error))
        self.total.assign_add(keras.ops.sum(error * w))
        self.weight.assign_add(keras.ops.sum(w))

    def result(self) -> Any:
        return keras.ops.divide_no_nan(self.total, self.weight)


class PositiveNegative(keras.metrics.Metric):
    """A dict result: the mean prediction over positive and over negative targets."""

    def __init__(self, name: str = "positive_negative", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.sums = self.add_variable(shape=(4,), initializer="zeros", name="sums")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        pos = keras.ops.cast(keras.ops.reshape(y_true, (-1,)) > 0.5, "float32")
        p = keras.ops.reshape(y_pred, (-1,))
        self.sums.assign_add(keras.ops.stack([keras.ops.sum(p * pos), keras.ops.sum(pos),
                                              keras.ops.sum(p * (1 - pos)), keras.ops.sum(1 - pos)]))

    def result(self) -> Any:
        return {"positive_mean": self.sums[0] / self.sums[1], "negative_mean": self.sums[2] / self.sums[3]}


def mean_abs_gap(y_true: Any, y_pred: Any) -> Any:
    """A metric (and loss) written as a plain function."""
    return keras.ops.mean(keras.ops.abs(keras.ops.cast(y_true, "float32") - y_pred), axis=-1)


class HalfSquaredError(keras.losses.Loss):
    """A ``Loss`` subclass."""

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return 0.5 * keras.ops.mean(keras.ops.square(keras.ops.cast(y_true, "float32") - y_pred), axis=-1)


CUSTOM_METRICS = {"binary": [CountAsVariable, PositiveNegative], "sparse": [CategoricalTruePositives],
                  "regression": [WeightedMeanError, lambda: mean_abs_gap]}
if JAX_GRID:
    # Keras 3.15 on JAX cannot run a result() that returns its variable, even on one process
    # ("Triggering __jax_array__() during abstractification"): the jax layouts run plain Keras.
    CUSTOM_METRICS = {"binary": [PositiveNegative], "regression": [WeightedMeanError, lambda: mean_abs_gap]}


def heads_model(heads: dict[str, str]) -> keras.Model:
    """One Dense head per name, with the activation of its task (``heads``: name -> task)."""
    inputs = keras.Input((D,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {name: keras.layers.Dense(UNITS[task], activation=ACTIVATION[task], name=name)(hidden)
               for name, task in heads.items()}
    return keras.Model(inputs, outputs)


def fixed_weights(model: keras.Model) -> None:
    rng = np.random.default_rng(11)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])


def metrics_case() -> dict[str, Any]:
    heads = {task: task for task in TASKS}
    metrics: dict[str, list[Any]] = {task: [] for task in TASKS}
    coupled = []
    for cls in public_classes(keras.metrics, keras.metrics.Metric):
        task, sums = head_for(cls, metric_value)
        if task is not None and not sums:
            coupled.append(cls.__name__)
        elif task is not None:
            metrics[task].append(constructed(cls, task))
    weighted = {task: [make() for make in CUSTOM_METRICS.get(task, [])] for task in TASKS}
    for task in TASKS:
        metrics[task] += [make() for make in CUSTOM_METRICS.get(task, [])]
    model = heads_model(heads)
    model.compile(keras.optimizers.SGD(0.0), loss={t: loss for t, loss in zip(TASKS, (
        "binary_crossentropy", "categorical_crossentropy", "sparse_categorical_crossentropy", "mse"))},
        metrics=metrics, weighted_metrics=weighted)
    return {"model": model, "targets": lambda y: {t: y[t] for t in TASKS}, "sample_weight": True,
            "names": {t: sorted(getattr(m, "__name__", type(m).__name__) for m in ms) for t, ms in metrics.items()},
            "batch_coupled": sorted(coupled)}


def loss_value(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> Any:
    return loss(y_true, y_pred, sample_weight=sample_weight)


def losses_case() -> dict[str, Any]:
    heads, losses, coupled = {}, {}, []
    classes = [cls for cls in public_classes(keras.losses, keras.losses.Loss) if cls.__name__ != "LossFunctionWrapper"]
    for cls in classes:
        task, mean = head_for(cls, loss_value)
        if task is not None and not mean:
            coupled.append(cls.__name__)
        elif task is not None:
            name = f"{cls.__name__.lower()}_{task}"
            heads[name], losses[name] = task, constructed(cls, task)
    heads["function_regression"], losses["function_regression"] = "regression", mean_abs_gap
    heads["subclass_regression"], losses["subclass_regression"] = "regression", HalfSquaredError()
    model = heads_model(heads)
    weights = {name: 0.5 + (i % 4) * 0.25 for i, name in enumerate(heads)}
    model.compile(keras.optimizers.SGD(0.0), loss=losses, loss_weights=weights)
    return {"model": model, "targets": lambda y: {name: y[task] for name, task in heads.items()},
            "sample_weight": True, "names": sorted(heads), "batch_coupled": sorted(coupled)}


def class_weight_case() -> dict[str, Any]:
    inputs = keras.Input((D,))
    outputs = keras.layers.Dense(CLASSES, activation="softmax")(keras.layers.Dense(8, activation="tanh")(inputs))
    model = keras.Model(inputs, outputs)

    def sparse_crossentropy(y_true: Any, y_pred: Any) -> Any:
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

    variables = [] if JAX_GRID else [CountAsVariable()]
    model.compile(keras.optimizers.SGD(0.0), loss=sparse_crossentropy, metrics=["accuracy", *variables],
                  weighted_metrics=[WeightedMeanError() if JAX_GRID else CategoricalTruePositives()])
    return {"model": model, "targets": lambda y: y["sparse"], "class_weight": {0: 0.5, 1: 2.0, 2: 1.0, 3: 1.5},
            "names": []}


class LastLogs(keras.callbacks.Callback):
    """The logs of the last batch end and the last epoch end of each loop."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, dict[str, float]] = {}

    def _keep(self, where: str, logs: Any) -> None:
        self.seen[where] = floats(logs or {})

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._keep("train_batch_end", logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._keep("epoch_end", logs)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self._keep("test_batch_end", logs)

    def on_test_end(self, logs: Any = None) -> None:
        self._keep("test_end", logs)


def floats(logs: dict[str, Any]) -> dict[str, Any]:
    return {k: np.asarray(v, dtype="float64").tolist() for k, v in logs.items()}


def run_case(case: dict[str, Any], loops: Any) -> dict[str, Any]:
    model, targets = case["model"], case["targets"]
    fixed_weights(model)
    x, y, sw = task_data(N, 0)
    vx, vy, _ = task_data(VAL, 1)
    weights = {"sample_weight": sw} if case.get("sample_weight") else {}
    weights.update({"class_weight": case["class_weight"]} if "class_weight" in case else {})
    fit_logs, test_logs = LastLogs(), LastLogs()
    history = loops.fit(model, x, targets(y), weights, (vx, targets(vy)), fit_logs)
    evaluated = loops.evaluate(model, x, targets(y), weights, test_logs, return_dict=False)
    as_dict = loops.evaluate(model, x, targets(y), weights, None, return_dict=True)
    predicted = loops.predict(model, vx)
    return {"history": {k: floats({"v": v})["v"] for k, v in history.history.items()},
            "evaluate": [np.asarray(v, dtype="float64").tolist() for v in np.atleast_1d(np.asarray(evaluated, dtype=object))],
            "evaluate_dict": floats(as_dict), "metrics_names": list(model.metrics_names),
            "fit_logs": fit_logs.seen, "test_logs": test_logs.seen,
            "predict": {k: np.asarray(v, dtype="float64").tolist() for k, v in
                        (predicted.items() if isinstance(predicted, dict) else [("output", predicted)])},
            "names": case["names"], "batch_coupled": case.get("batch_coupled", [])}


class PlainLoops:
    """Plain single-process Keras: the reference, as Keras means its values.

    Two quirks of Keras 3.15 on TensorFlow are kept out of it:

    * its History keeps what ``result()`` returned: a variable, which the validation's
      ``evaluate`` then resets and fills (the training epoch shows the validation value).
      So the reference trains without ``validation_data`` and adds the validation logs
      from ``evaluate``; at learning rate 0 every epoch's are the same;
    * its per-output loss trackers (``<output>_loss``) weigh a batch by its static size, or
      by 1 once the traced step no longer knows the size, so their value depends on how the
      steps were traced. Over one batch they are exact: the reference runs every loop on
      one batch (every metric here is a sum over examples, so batching changes nothing else).
    """

    def fit(self, model, x, y, weights, validation, callback):
        history = model.fit(x, y, batch_size=len(x), epochs=2, callbacks=[callback], shuffle=False, verbose=0,
                            **weights)
        vx, vy = validation
        val = model.evaluate(vx, vy, batch_size=len(vx), callbacks=[callback], verbose=0, return_dict=True)
        val = {f"val_{k}": v for k, v in floats(val).items()}
        history.history.update({k: [v] * 2 for k, v in val.items()})
        callback.seen["epoch_end"].update(val)
        return history

    def evaluate(self, model, x, y, weights, callback, return_dict):
        return model.evaluate(x, y, batch_size=len(x), callbacks=[callback] if callback else None, verbose=0,
                              return_dict=return_dict, **{k: v for k, v in weights.items() if k == "sample_weight"})

    def predict(self, model, x):
        return model.predict(x, batch_size=BATCH, verbose=0)


class DistributedLoops(PlainLoops):
    def fit(self, model, x, y, weights, validation, callback):
        import keras_distrib

        return keras_distrib.fit(model, x, y, batch_size=BATCH, epochs=2, validation_data=validation,
                                 callbacks=[callback], verbose=0, **weights)

    def evaluate(self, model, x, y, weights, callback, return_dict):
        import keras_distrib

        return keras_distrib.evaluate(model, x, y, batch_size=BATCH, callbacks=[callback] if callback else None,
                                      verbose=0, return_dict=return_dict,
                                      **{k: v for k, v in weights.items() if k == "sample_weight"})

    def predict(self, model, x):
        import keras_distrib

        return keras_distrib.predict(model, x, batch_size=BATCH)


class JaxLoops(PlainLoops):
    """The jax layouts (plain Keras under a distribution): a tf.data.Dataset of global
    batches, as docs/jax.md asks."""

    @staticmethod
    def batches(*parts):
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(tuple(p for p in parts if p is not None)).batch(BATCH)

    def fit(self, model, x, y, weights, validation, callback):
        train = self.batches(x, y, weights.get("sample_weight"))
        return model.fit(train, epochs=2, validation_data=self.batches(*validation), callbacks=[callback],
                         verbose=0, **{k: v for k, v in weights.items() if k == "class_weight"})

    def evaluate(self, model, x, y, weights, callback, return_dict):
        return model.evaluate(self.batches(x, y, weights.get("sample_weight")), verbose=0, return_dict=return_dict,
                              callbacks=[callback] if callback else None)

    def predict(self, model, x):
        import keras_distrib  # Keras' own model.predict cannot read outputs that span processes

        return keras_distrib.predict(model, x, batch_size=BATCH)


CASES = {"metrics": metrics_case, "losses": losses_case, "class_weight": class_weight_case}


def choose_heads() -> None:
    """Every class's head, chosen before any strategy scope (`head_for` is cached): a metric
    updated eagerly under a distribution strategy is not the plain one the choice is about."""
    for cls in public_classes(keras.metrics, keras.metrics.Metric):
        head_for(cls, metric_value)
    for cls in public_classes(keras.losses, keras.losses.Loss):
        head_for(cls, loss_value)


def main() -> None:
    chosen = sys.argv[1:] or list(CASES)
    out = {}
    if not LAYOUT:
        loops: Any = PlainLoops()
        scope = None
    elif ON_JAX:
        import keras_distrib

        keras_distrib.distribution()
        loops, scope = JaxLoops(), None
    else:
        import keras_distrib

        loops, scope = DistributedLoops(), keras_distrib.strategy().scope
    choose_heads()  # after the strategy (created before any TensorFlow op), outside its scope
    for name in chosen:
        if scope is None:
            case = CASES[name]()
        else:
            with scope():
                case = CASES[name]()
        out[name] = run_case(case, loops)
    if ON_JAX:  # every process ran the loops; process 0 writes where the test reads
        import keras_distrib

        if keras_distrib.cluster().is_chief:
            with open(os.environ["METRIC_CONTRACT_OUT"], "w") as f:
                json.dump(out, f)
        return
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
