"""Metrics for models fed example ids as targets: `Count` reads the examples seen in an epoch,
`IdSum` the sum of their ids, so an example seen twice or missed changes one of them.

Imported by the test scripts that clusters run (tests/local is on their path) and by tests;
written with keras.ops, so they run on the TensorFlow and the JAX backend.
"""

from __future__ import annotations

from typing import Any

import keras


class Count(keras.metrics.Metric):
    def __init__(self, name: str = "count", **kw: Any) -> None:
        super().__init__(name=name, **kw)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        self.total.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], self.total.dtype))

    def result(self) -> Any:
        return self.total + 0.0  # a tensor, not the variable: results are computed statelessly


class IdSum(Count):
    def __init__(self, name: str = "idsum", **kw: Any) -> None:
        super().__init__(name=name, **kw)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        self.total.assign_add(keras.ops.sum(keras.ops.cast(y_true, self.total.dtype)))
