"""All-reduce over an already batched input: its batch is the global batch, cut into one
slice per replica (trainers/allreduce_input.py `_replica_slices`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytestmark = pytest.mark.unit

tf = pytest.importorskip("tensorflow")

from keras_distrib.trainers.allreduce_input import _replica_slices  # noqa: E402


def batches(n: int, batch: int) -> "tf.data.Dataset":
    ids = np.arange(n, dtype="float32")
    return tf.data.Dataset.from_tensor_slices(({"x": ids[:, None]}, ids)).batch(batch)


@pytest.mark.parametrize("n,batch,pipelines,local", [(100, 32, 3, 1), (7, 2, 3, 1), (64, 32, 2, 2),
                                                      (5, 4, 2, 3), (33, 33, 4, 1)])
def test_every_example_once_per_step_no_empty_batch(n: int, batch: int, pipelines: int, local: int) -> None:
    steps = -(-n // batch)
    streams = [list(_replica_slices(batches(n, batch), p, pipelines, local, masked=True, endless=False)
                    .take(steps * local)) for p in range(pipelines)]
    for step in range(steps):
        rows, sizes = [], []
        for p, j in itertools.product(range(pipelines), range(local)):
            (x, y), mask = streams[p][step * local + j]
            assert len(y) == len(mask) >= 1  # never an empty batch: padding at weight 0 instead
            assert np.array_equal(x["x"][:, 0], y)
            real = y.numpy()[mask.numpy() > 0]
            rows += real.tolist()
            sizes.append(len(real))
        start = step * batch
        assert sorted(rows) == list(range(start, min(n, start + batch)))  # the global batch, once
        assert max(sizes) - min(sizes) <= 1


def test_after_the_last_batch_padding_follows_unless_endless() -> None:
    tail = list(_replica_slices(batches(4, 2), 0, 2, 1, masked=True, endless=False).take(4))
    assert [float(m.numpy().sum()) for _, m in tail] == [1.0, 1.0, 0.0, 0.0]
    assert len(list(_replica_slices(batches(4, 2), 0, 2, 1, masked=True, endless=True))) == 2


def test_the_models_own_step_stops_on_a_batch_smaller_than_the_replicas() -> None:
    """No padding for a model's own train_step: an empty slice is an error with a HINT."""
    own = _replica_slices(batches(5, 2), 0, 2, 1, masked=False, endless=True, method="train_step")
    it = iter(own)
    assert len(next(it)[1]) == 1 and len(next(it)[1]) == 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="own train_step got a batch with fewer .*HINT"):
        next(it)
