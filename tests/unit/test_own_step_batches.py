"""The all-reduce rule for a model's own train_step/test_step: every replica gets a real,
non-empty batch at every step (no padding), or the input is refused with a HINT."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from keras_distrib import data as kd_data
from keras_distrib.trainers._common import TrainerError
from keras_distrib.trainers.allreduce_input import equal_batches, own_step_batches

pytestmark = pytest.mark.unit


@dataclass
class FakeSource:
    num_examples: int | None
    batched: bool = False


@pytest.mark.parametrize("n,batches,batch", [(21, 3, 10), (20, 3, 10), (5, 5, 4), (7, 2, 4), (100, 7, 16)])
def test_equal_batches_cover_every_example_in_non_empty_batches(n: int, batches: int, batch: int) -> None:
    sizes = equal_batches(n, batches, batch)
    assert len(sizes) == batches and sum(sizes) == n
    assert all(1 <= s <= batch for s in sizes)
    assert sizes == sorted(sizes, reverse=True)  # full batches first


@pytest.mark.parametrize("n", [41, 203, 1001, 12, 9])
@pytest.mark.parametrize("pipelines,replicas", [(2, 2), (3, 3), (1, 2), (2, 4)])
@pytest.mark.parametrize("per_replica", [1, 4, 10, 16])
def test_every_pipeline_yields_the_same_real_batches_or_refuses(n: int, pipelines: int, replicas: int,
                                                              per_replica: int) -> None:
    source = FakeSource(n)
    shards = kd_data.shard_sizes(n, pipelines)
    local = replicas // pipelines
    try:
        steps, sizes = own_step_batches(source, pipelines=pipelines, replicas=replicas, per_replica=per_replica,
                                        repeat=False, method="train_step")
    except TrainerError as exc:
        assert "HINT: pass steps_per_epoch=" in str(exc) and "train_step" in str(exc)
        need = max(math.ceil(math.ceil(s / per_replica) / local) for s in shards) * local
        assert min(shards) < need  # refused only where the rule cannot hold
        return
    assert sizes is not None and len(sizes) == pipelines
    for shard, batch_sizes in zip(shards, sizes):
        assert sum(batch_sizes) == shard and len(batch_sizes) == steps * local
        assert all(1 <= s <= per_replica for s in batch_sizes)
    # As many steps as the default (padded) step would run: the longest shard decides.
    assert steps == max(math.ceil(math.ceil(s / per_replica) / local) for s in shards)


def test_batched_inputs_are_one_step_per_global_batch() -> None:
    """The input's batch is the global batch: every replica gets a slice of each."""
    for batches, pipelines, replicas in ((12, 3, 3), (13, 3, 3), (1, 2, 4)):
        assert own_step_batches(FakeSource(batches, batched=True), pipelines=pipelines, replicas=replicas,
                                per_replica=None, repeat=False, method="test_step") == (batches, None)
    with pytest.raises(TrainerError, match="unknown"):
        own_step_batches(FakeSource(None, batched=True), pipelines=2, replicas=2, per_replica=None,
                         repeat=False, method="test_step")
    # steps_per_epoch (repeat): every shard repeats, nothing to shape.
    assert own_step_batches(FakeSource(None), pipelines=2, replicas=2, per_replica=4, repeat=True,
                            method="train_step") == (None, None)
