"""`steps.compiled` traces Python as it is, as Keras compiles its steps (``do_not_convert``):
no AutoGraph, so no conversion cost at a process's first trace, and a step written with
Python control flow on a tensor fails the same way under keras_distrib as under Keras."""

from __future__ import annotations

import pytest

from keras_distrib.trainers.steps import compiled

pytestmark = pytest.mark.unit


def test_python_control_flow_on_a_tensor_is_not_converted() -> None:
    tf = pytest.importorskip("tensorflow")

    def step(x: object) -> object:
        if tf.reduce_sum(x) > 0:  # AutoGraph would turn this into a tf.cond
            return x + 1
        return x - 1

    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        compiled(step)(tf.constant([1.0]))


def test_graph_control_flow_written_out_runs() -> None:
    tf = pytest.importorskip("tensorflow")

    def count_up(n: object) -> object:
        return tf.while_loop(lambda i, total: i < n, lambda i, total: (i + 1, total + i), (0, 0))[1]

    assert int(compiled(count_up)(tf.constant(5))) == 0 + 1 + 2 + 3 + 4
    assert int(compiled(count_up, retrace_less=True)(tf.constant(3))) == 3
