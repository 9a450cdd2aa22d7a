"""`MetricSet` in one process: results read as values, lazily built metrics, per-output losses.

The trainers keep metric state as tensors and read ``result()`` over the summed state
(keras_distrib/trainers/metrics.py); these check that reading against plain Keras on the same
batches, eagerly (the distributed grid is tests/local/test_metric_contract.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from keras_distrib.trainers.metrics import MetricSet, result_values  # noqa: E402

pytestmark = pytest.mark.unit


def _guides_metrics() -> Any:
    """tests/local/metric_contract_script.py, where the custom metrics of Keras' guides live."""
    path = Path(__file__).resolve().parents[1] / "local" / "metric_contract_script.py"
    spec = importlib.util.spec_from_file_location("metric_contract_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # definitions only: it runs nothing on import
    return module


CountAsVariable = _guides_metrics().CountAsVariable


class DictOfVariables(CountAsVariable):
    def result(self) -> Any:
        return {"seen": self.n, "twice": self.n * 2.0}


def data(n: int, seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, {"a": (rng.random((n, 1)) < 0.5).astype("float32"), "b": rng.normal(size=(n, 2)).astype("float32")}


def two_outputs(metrics: Any, loss_weights: Any = None) -> Any:
    inputs = keras.Input((3,))
    model = keras.Model(inputs, {"a": keras.layers.Dense(1, activation="sigmoid", name="a")(inputs),
                                 "b": keras.layers.Dense(2, name="b")(inputs)})
    model.compile("sgd", loss={"a": "binary_crossentropy", "b": "mse"}, metrics=metrics, loss_weights=loss_weights)
    return model


def run_steps(model: Any, batches: list[tuple[Any, Any]]) -> dict[str, Any]:
    """What the trainers do per step, eagerly: the loss in the set's scope, then update."""
    metrics = MetricSet(model)
    metrics.build(model, batches[0])
    state = metrics.initial_state()
    for x, y in batches:
        y_pred = model(x, training=False)
        with metrics.loss_scope(state) as scope:
            model.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        n = x.shape[0]
        state = metrics.update(state, y, y_pred, None, loss_scope=scope, rows=n, examples=n)
    return metrics.results([np.asarray(s) for s in state])


def test_a_result_returned_as_its_variable_reads_the_state_not_the_variable() -> None:
    metric = CountAsVariable()
    assert float(result_values(metric, [np.float32(295.0)])) == 295.0
    assert float(metric.n.numpy()) == 0.0  # the variable itself was never written
    values = result_values(DictOfVariables(), [np.float32(7.0)])
    assert {k: float(v) for k, v in values.items()} == {"seen": 7.0, "twice": 14.0}


def test_every_result_shape_equals_plain_keras_on_the_same_batches() -> None:
    batches = [data(13, 1), data(5, 2)]
    metrics = {"a": [CountAsVariable(), DictOfVariables(name="dict_of_variables"), "accuracy",
                     keras.metrics.F1Score(average=None, threshold=0.5), keras.metrics.AUC()],
               "b": [keras.metrics.R2Score(), "mae"]}
    model = two_outputs(metrics, loss_weights={"a": 0.5, "b": 2.0})
    got = run_steps(model, batches)
    keras_logs = model.evaluate(np.concatenate([b[0] for b in batches]),
                                {k: np.concatenate([b[1][k] for b in batches]) for k in ("a", "b")},
                                batch_size=18, verbose=0, return_dict=True)
    assert got["a_count_as_variable"] == 18.0 and got["seen"] == 18.0 and got["twice"] == 36.0
    for key, value in keras_logs.items():
        if key == "loss":  # the total is the trainers' own sum (Totals), not a metric
            continue
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(value), rtol=1e-5, err_msg=key)


def test_per_output_losses_are_example_means_whatever_the_batching() -> None:
    model = two_outputs(metrics=None)
    x, y = data(18, 3)
    whole = run_steps(model, [(x, y)])
    split = run_steps(model, [(x[:13], {k: v[:13] for k, v in y.items()}), (x[13:], {k: v[13:] for k, v in y.items()})])
    y_pred = model(x, training=False)
    exact = {"a_loss": float(np.mean(keras.losses.binary_crossentropy(y["a"], y_pred["a"]))),
             "b_loss": float(np.mean(keras.losses.mean_squared_error(y["b"], y_pred["b"])))}
    assert set(whole) == set(split) == set(exact)
    for key, value in exact.items():
        assert whole[key] == pytest.approx(value, rel=1e-5) and split[key] == pytest.approx(value, rel=1e-5)


def test_metrics_that_build_their_state_on_first_update_are_in_the_state_from_the_start() -> None:
    model = two_outputs({"a": [keras.metrics.F1Score()], "b": [keras.metrics.R2Score()]})
    metrics = MetricSet(model)
    metrics.build(model, data(4))
    before = len(metrics.initial_state())
    x, y = data(6, 5)
    y_pred = model(x, training=False)
    assert len(metrics.update(metrics.initial_state(), y, y_pred, None)) == before
