"""How the parameter-server trainer ends an exact epoch.

Its closures run their K steps unguarded when the first batch says at least K are left
(`with_countdown`), so the count must be exact for every shard size, including empty
shards and sizes that do not divide by the batch. And it keeps no more closures in flight
than the unfinished shards need, but never fewer than one per worker (`_window`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.unit

tf = pytest.importorskip("tensorflow")

from keras_distrib import data as kd  # noqa: E402
from keras_distrib.trainers.ps import ParameterServerTrainer  # noqa: E402
from keras_distrib.trainers.ps.readers import Batches, with_countdown  # noqa: E402


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


@pytest.mark.parametrize("workers,per_shard,done,want", [
    (2, None, {}, 8),                   # sizes unknown: the full window, 4 per worker
    (2, [13, 13], {}, 4),               # 2 closures of 10 per shard
    (2, [13, 13], {0: 10}, 3),          # shard 0 needs 1 more, shard 1 still 2
    (2, [13, 13], {0: 13, 1: 10}, 2),   # 1 needed, but one per worker stays in flight
    (3, [11, 10, 10], {0: 11, 1: 10, 2: 10}, 3),
    (3, [400, 400, 400], {}, 12),       # large shards: capped by the window
])
def test_closures_in_flight_follow_what_the_shards_still_need(workers: int, per_shard: list[int] | None,
                                                               done: dict[int, int], want: int) -> None:
    trainer = SimpleNamespace(num_workers=workers, steps_per_execution=10)
    assert ParameterServerTrainer._window(trainer, per_shard, done) == want  # type: ignore[arg-type]


def test_batches_give_the_fetched_one_first_then_the_rest() -> None:
    ds = with_countdown(tf.data.Dataset.range(5).batch(2))
    iterator = iter(ds)
    left, first = next(iterator)
    batches = Batches(iterator, first)
    got = [next(batches).numpy().tolist() for _ in range(int(left))]
    assert got == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("base,folded,lost,counted,want", [
    (0, 300, [], 300, None),            # no closure ran again
    (7200, 471, [9], 7689, 7680),       # CI's chaos replay: a closure of 9 counted twice, its result lost
    (2400, 408, [], 2818, 2808),        # a closure ran again, its re-run's result folded: counted twice
    (100, 90, [10], 200, None),         # its result lost, counted once: as it should be
    (100, 90, [10], 195, None),         # the lost one ran fewer steps (its shard's end): never raised
    (0, 40, [10, 10], 80, 60),          # two lost closures, one of them run twice
])
def test_the_chief_sets_a_step_counter_that_counted_a_closure_twice_back(base: int, folded: int, lost: list[int],
                                                                         counted: int, want: int | None) -> None:
    from keras_distrib.trainers.ps.chief import settled_step

    assert settled_step(base, folded, lost, counted) == want
