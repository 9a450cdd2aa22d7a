"""The parameter-server trainer's counted shards: each batch knows how many are left.

The closures of `ParameterServerTrainer` run their K steps unguarded when the first batch
says at least K are left (`with_countdown`), so the count must be exact for every shard
size, including empty shards and sizes that do not divide by the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.unit

tf = pytest.importorskip("tensorflow")

from keras_distrib import data as kd  # noqa: E402
from keras_distrib.trainers.ps_async import _Batches, with_countdown  # noqa: E402


@pytest.mark.parametrize("n,batch,shards", [(0, 4, 1), (1, 4, 2), (10, 3, 3), (403, 16, 2), (31, 30, 3)])
def test_every_batch_knows_how_many_are_left(n: int, batch: int, shards: int) -> None:
    x = np.arange(n, dtype=np.int64)
    for index in range(shards):
        ds = kd.pipeline(kd.as_source((x, x)), index, shards, batch_size=batch, shuffle=False, seed=None, repeat=False)
        counted = list(with_countdown(ds).as_numpy_iterator())
        plain = list(ds.as_numpy_iterator())
        assert [int(left) for left, _ in counted] == list(range(len(plain), 0, -1))
        for (_, (cx, _)), (px, _) in zip(counted, plain):
            np.testing.assert_array_equal(cx, px)  # the same batches, in the same order


def test_unknown_cardinality_is_not_counted() -> None:
    ds = tf.data.Dataset.range(10).filter(lambda v: v % 2 == 0)
    assert int(ds.cardinality()) < 0  # PerWorkerInput.counted is False for such inputs


def test_batches_give_the_fetched_one_first_then_the_rest() -> None:
    ds = with_countdown(tf.data.Dataset.range(5).batch(2))
    iterator = iter(ds)
    left, first = next(iterator)
    batches = _Batches(iterator, first)
    got = [next(batches).numpy().tolist() for _ in range(int(left))]
    assert got == [[0, 1], [2, 3], [4]]
