"""The epoch logs of a model's own train_step/test_step follow Keras' rule
(``Trainer._get_metrics_result_or_logs``), with metric results read over every worker."""

from __future__ import annotations

from typing import Any

import pytest

from keras_distrib.trainers.steps import epoch_logs

pytestmark = pytest.mark.unit


class FakeModel:
    """The model's metric results as read over every worker at the epoch's end."""

    def __init__(self, results: dict[str, Any]) -> None:
        self.results = results

    def get_metrics_result(self) -> dict[str, Any]:
        return self.results


OVER_WORKERS = FakeModel({"loss": 0.5, "mae": 0.25})  # what every worker's updates add up to


def test_keys_that_are_the_metric_names_give_the_results_over_every_worker() -> None:
    assert epoch_logs(OVER_WORKERS, {"loss": 0.9, "mae": 0.8}) == {"loss": 0.5, "mae": 0.25}


def test_a_top_level_value_of_the_step_is_its_own_even_beside_compile_metrics() -> None:
    """The defect: ``{"compile_metrics": ..., "loss": loss + 100}``, flattened, has the metric
    names as keys, and the 100 was lost (History said 0.5; plain Keras says 100.7)."""
    last = {"compile_metrics": {"loss": 0.7, "mae": 0.8}, "loss": 100.7}
    assert epoch_logs(OVER_WORKERS, last) == {"loss": 100.7, "mae": 0.25}


def test_nested_metric_results_are_read_over_every_worker() -> None:
    """``{m.name: m.result() for m in self.metrics}`` of a compiled model nests the compiled
    metrics under ``compile_metrics``: they are results, so the value over every worker."""
    last = {"loss": 0.9, "compile_metrics": {"mae": 0.8}}
    assert epoch_logs(OVER_WORKERS, last) == {"loss": 0.9, "mae": 0.25}


def test_keras_flattening_order_a_later_dict_overrides_an_earlier_top_level_key() -> None:
    last = {"a_loss": 3.0, "z": {"a_loss": 4.0}}  # sorted: "a_loss", then "z"'s "a_loss"
    assert epoch_logs(FakeModel({"a_loss": 5.0}), last) == {"a_loss": 5.0}


def test_own_names_stay_and_unbuilt_metrics_keep_the_step_logs() -> None:
    gan = {"d_loss": 1.5, "g_loss": 2.5}
    assert epoch_logs(OVER_WORKERS, gan) == gan

    class Unbuilt:
        def get_metrics_result(self) -> dict[str, Any]:
            raise ValueError("metric not built")

    assert epoch_logs(Unbuilt(), {"compile_metrics": {"mae": 0.8}, "loss": 1.0}) == {"mae": 0.8, "loss": 1.0}


class Box:
    """A fresh object per result() call, as a metric's result tensor is."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np

        return np.asarray(self.value, dtype=dtype)


class FakeMetric:
    def __init__(self, name: str, value: float) -> None:
        self.name, self.value = name, value

    def result(self) -> Box:
        return Box(self.value)


class ModelWithSteps(FakeModel):
    def __init__(self) -> None:
        super().__init__({"loss": 0.5, "mae": 0.25})
        self.metrics = [FakeMetric("loss", 0.9), FakeMetric("mae", 0.8)]

    def test_step(self, data: Any) -> dict[str, Any]:
        """The guide's custom test_step returns the metrics' results as they are."""
        return {"loss": self.metrics[0].result(), "compile_metrics": {"mae": self.metrics[1].result()}}

    def train_step(self, data: Any) -> dict[str, Any]:
        """Its own loss under the tracker's name: not a result."""
        return {"loss": Box(100.7), "compile_metrics": {"mae": self.metrics[1].result()}}


def test_a_metric_result_returned_at_the_top_level_is_read_over_every_worker() -> None:
    """A value returned as ``metric.result()`` gave it is that metric's, read at the end over
    every worker (a step's snapshot raced other workers' updates: val_loss 862 for 1000+);
    a value the step computed stays its own."""
    from keras_distrib.trainers.steps import noting_metric_results

    model = ModelWithSteps()
    last_test = noting_metric_results(model.test_step)(None)
    last_train = noting_metric_results(model.train_step)(None)
    assert "result" not in vars(model.metrics[0])  # the metrics are as they were
    assert epoch_logs(model, last_test, "test_step") == {"loss": 0.5, "mae": 0.25}
    assert epoch_logs(model, last_train, "train_step") == {"loss": 100.7, "mae": 0.25}
