"""All-reduce epochs of known size (trainers/allreduce_input.py `step_counts`, `EpochInput.counts`):
where every shard's size is known before the epoch, each step's example count over every
worker is computed once instead of all-reduced at every step. The counts must be what the
workers' real pipelines hold, step by step, for sizes that do not divide."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytestmark = pytest.mark.unit

tf = pytest.importorskip("tensorflow")

from keras_distrib import data as kd_data  # noqa: E402
from keras_distrib.trainers.allreduce_input import EpochInput, step_counts  # noqa: E402


class FakeStrategy:
    def __init__(self, replicas: int) -> None:
        self.num_replicas_in_sync = replicas


def pipeline_batch_sizes(source: kd_data.Source, pipelines: int, per_replica: int) -> list[list[int]]:
    """Each worker's real batches, read from the pipeline the trainer builds."""
    return [[int(tf.shape(tf.nest.flatten(b)[0])[0])
             for b in kd_data.pipeline(source, p, pipelines, batch_size=per_replica, shuffle=True, seed=3,
                                       repeat=False, epoch=1)]
            for p in range(pipelines)]


@pytest.mark.parametrize("n,per_replica,pipelines", [(401, 7, 2), (449, 10, 3), (31, 10, 3), (64, 16, 2),
                                                      (5, 4, 3), (1, 8, 2), (0, 8, 2)])
def test_counts_are_the_real_batches_step_by_step(n: int, per_replica: int, pipelines: int) -> None:
    source = kd_data.ArraySource((np.arange(n, dtype="float32")[:, None], np.arange(n)))
    sizes = pipeline_batch_sizes(source, pipelines, per_replica)
    real = [sum(step) for step in itertools.zip_longest(*sizes, fillvalue=0)]
    assert step_counts(source.shard_sizes(pipelines), per_replica) == real
    assert sum(real) == n


@pytest.mark.parametrize("make,counted", [
    (lambda: kd_data.ArraySource((np.zeros((449, 2), "float32"), np.zeros(449))), True),
    (lambda: kd_data.DatasetSource(tf.data.Dataset.range(449).map(lambda i: (tf.cast(i, tf.float32), i))), True),
    # tf.data does not know how many a filter keeps; a batched input's batch is the global batch.
    (lambda: kd_data.DatasetSource(tf.data.Dataset.range(449).filter(lambda i: i % 2 == 0)), False),
    (lambda: kd_data.DatasetSource(tf.data.Dataset.range(449).batch(30)), False),
])
def test_the_known_size_path_is_taken_only_where_the_size_is_known(make, counted: bool) -> None:
    for workers in (2, 3):
        inp = EpochInput(FakeStrategy(workers), make(), per_replica=10, shuffle=False, seed=None, repeat=False,
                         pipelines=workers)
        assert (inp.counts is not None) == counted
        if counted:  # the longest shard, in batches of 10
            longest = -(-449 // workers)
            assert sum(inp.counts) == 449 and len(inp.counts) == -(-longest // 10)


def test_repeated_input_and_several_replicas_per_worker_keep_the_per_step_count() -> None:
    source = kd_data.ArraySource((np.zeros((449, 2), "float32"), np.zeros(449)))
    assert EpochInput(FakeStrategy(2), source, per_replica=10, shuffle=False, seed=None, repeat=True,
                      pipelines=2).counts is None
    # 2 workers with 2 GPUs each: the count stays measured (the known-size path is one replica per worker).
    assert EpochInput(FakeStrategy(4), source, per_replica=10, shuffle=False, seed=None, repeat=False,
                      pipelines=2).counts is None
