"""The parts of an epoch handed out dynamically in the parameter-server layouts (issue 28):
every row once, the steps of fixed shards, the same rows whoever runs them and wherever a
resumed epoch starts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from keras_distrib.data import epoch_parts, shard_rows, shard_sizes, tail_part_limit

pytestmark = pytest.mark.unit


def _steps_of_fixed_shards(n: int, shards: int, batch: int) -> int:
    return sum(-(-size // batch) for size in shard_sizes(n, shards))


@pytest.mark.parametrize("n, shards, batch, k, shuffle", [
    (n, shards, batch, k, shuffle)
    for n, shards, batch, k, shuffle in itertools.product((1, 2, 7, 100, 1347), (1, 2, 3), (1, 4, 32), (1, 3, 10),
                                                          (False, True))
])
def test_every_row_once_in_the_steps_of_fixed_shards(n: int, shards: int, batch: int, k: int, shuffle: bool) -> None:
    rows = shard_rows(n, shards, epoch=2, shuffle=shuffle, seed=5)
    parts = list(epoch_parts(rows, batch, k))
    seen = np.concatenate([r for _, r in parts]) if parts else np.array([], np.int64)
    assert sorted(seen.tolist()) == list(range(n))
    assert sum(steps for steps, _ in parts) == _steps_of_fixed_shards(n, shards, batch)
    for steps, part in parts:
        assert 1 <= steps <= k
        assert (steps - 1) * batch < len(part) <= steps * batch  # only a shard's last batch is short
        assert len({int(r) % shards for r in part}) == 1  # one shard's rows


def test_a_resumed_epoch_trains_exactly_the_rows_left() -> None:
    rows = shard_rows(1347, 3, epoch=4, shuffle=True, seed=0)
    full = list(epoch_parts(rows, 32, 10))
    total = sum(steps for steps, _ in full)
    flat = np.concatenate([r for _, r in full])
    for first in range(total):
        rest = list(epoch_parts(rows, 32, 10, first, total - first))
        assert sum(steps for steps, _ in rest) == total - first
        tail = np.concatenate([r for _, r in rest])
        assert (flat[-len(tail):] == tail).all(), first


def test_validation_steps_take_the_first_steps() -> None:
    rows = shard_rows(100, 2, epoch=0, shuffle=False, seed=None)
    parts = list(epoch_parts(rows, 4, 10, 0, 13))
    assert sum(steps for steps, _ in parts) == 13
    assert np.concatenate([p for _, p in parts]).tolist() == list(range(0, 80, 2))[:40] + list(range(1, 24, 2))


@pytest.mark.parametrize("shards", [2, 3])
def test_parts_shrink_near_the_end_so_a_slow_worker_holds_little(shards: int) -> None:
    """K-step parts while more than 2 * workers * K steps are left; then about left / (2 * workers),
    so the epoch's last part is a step or two, not K (a worker at half speed holding a K-step
    part kept the others idle for K steps)."""
    rows = shard_rows(3001, shards, epoch=0, shuffle=False, seed=None)
    parts = [steps for steps, _ in epoch_parts(rows, 8, 10)]
    left = np.cumsum(parts[::-1])[::-1]  # steps left when each part was handed out
    assert all(steps == 10 for steps, rest in zip(parts, left) if rest > 2 * shards * 10 + 10)
    assert max(parts[-shards:]) <= 2 and len(parts) < sum(parts) / 10 + 4 * shards + 10


@pytest.mark.parametrize("left, k, workers, unit, want", [
    (1000, 10, 2, 1, 10), (40, 10, 2, 1, 10), (39, 10, 2, 1, 10), (36, 10, 2, 1, 9), (5, 10, 2, 1, 2), (1, 10, 3, 1, 1), (5, 10, 1, 1, 5), (15, 10, 1, 1, 10),
    (1000, 10, 3, 3, 9), (7, 10, 3, 3, 3), (30, 10, 2, 2, 8), (3, 1, 2, 2, 2)])
def test_tail_part_limit(left: int, k: int, workers: int, unit: int, want: int) -> None:
    assert tail_part_limit(left, k, workers, unit) == want


def test_each_epoch_a_new_order_reproducible_from_the_seed() -> None:
    def order(epoch: int, seed: int) -> list[int]:
        return np.concatenate(shard_rows(500, 2, epoch=epoch, shuffle=True, seed=seed)).tolist()

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != order(1, 1)
    assert np.concatenate(shard_rows(5, 2, epoch=3, shuffle=False, seed=1)).tolist() == [0, 2, 4, 1, 3]


@pytest.mark.parametrize(("workers", "k"), [(1, 10), (2, 10), (3, 10), (4, 10), (3, 7), (12, 10)])
def test_a_streams_parts_are_full_but_for_the_epochs_tail(workers: int, k: int) -> None:
    """A tf.data stream's parts are whole runs of one batch per worker: all but the last few
    hold `full_part` batches, the count run unrolled (a Python int, as K is); 3 workers and
    K=10 give parts of 9, which ran in the slower counted loop before."""
    pytest.importorskip("tensorflow")
    from keras_distrib.trainers.ps.handout import DynamicDatasetInput, steps_arg

    stream = object.__new__(DynamicDatasetInput)  # parts() needs only the run size
    stream.per_run = workers
    full = stream.full_part(k)
    assert full % workers == 0 and (full <= k or full == workers)
    sizes = [n for n, _ in stream.parts(0, 0, 1000, k)]
    assert sum(sizes) == 1000
    tail = next((i for i, n in enumerate(sizes) if n != full), len(sizes))
    assert set(sizes[:tail]) == {full} and sum(sizes[tail:]) <= 2 * workers * k
    assert isinstance(steps_arg(full, full), int)
    assert all(not isinstance(steps_arg(n, full), int) for n in sizes[tail:] if n != full)


def test_one_stream_serves_every_epoch_of_a_fit_until_dropped() -> None:
    """`FitStream`: made once for epochs first..last and handed out for each of them; made
    anew for an epoch outside them, for another last epoch, and after `drop` (an epoch
    stopped before its end)."""
    from keras_distrib.trainers._common import FitStream

    made: list[tuple[int, int]] = []
    stream = FitStream(lambda first, last: made.append((first, last)) or len(made))
    assert [stream.get(e, 4) for e in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert stream.get(0, 4) == 2  # before the stream's first epoch
    assert stream.get(3, 5) == 3  # another fit's last epoch
    stream.drop()
    assert stream.get(4, 5) == 4
    assert made == [(1, 4), (0, 4), (3, 5), (4, 5)]


def test_an_epoch_end_is_saved_as_the_next_epochs_start() -> None:
    """An epoch of files ran 73 steps where 61 were estimated from ``num_examples``: its
    end is saved as the start of the next epoch, not 36 steps into it."""
    from types import SimpleNamespace

    from keras_distrib.checkpoints import position
    from keras_distrib.trainers.base import Trainer

    checkpointer = SimpleNamespace(origin=(0, 0), steps_per_epoch=61)
    saved: list[tuple[int, int]] = []
    keeper = SimpleNamespace(checkpointer=checkpointer,
                             save=lambda step: saved.append(position(step, checkpointer.steps_per_epoch,
                                                                     checkpointer.origin)))
    trainer = SimpleNamespace(global_step=SimpleNamespace(numpy=lambda: 219), _last_epoch=5)
    Trainer._save_checkpoint(trainer, keeper, 3)  # type: ignore[arg-type]
    assert saved == [(3, 0)]
    assert position(219 + 30, 61, checkpointer.origin) == (3, 30)  # a mid-epoch save after it


@pytest.mark.parametrize("sizes, k, window", [
    ([17, 53], 4, 8), ([53, 17], 4, 8), ([5, 5], 10, 8), ([0, 31], 3, 4), ([30, 30, 30], 10, 12),
    ([1, 44, 7], 5, 12), ([100], 10, 4), ([9, 10, 11], 10, 12),
])
def test_an_unguarded_closure_never_finds_its_shard_short(sizes: list[int], k: int, window: int) -> None:
    """The chief sends a closure unguarded only when every shard can fill it past all the
    steps in flight (`shards_can_fill`). Simulated: the coordinator's queue hands closures
    out oldest first, each to whichever worker is free (here: a random one), and `_run`
    folds them oldest first, at random moments; a guarded closure runs what its worker's
    shard has left. No unguarded closure finds fewer batches
    than its steps, every shard is drained, and all but each shard's tail runs unguarded."""
    from keras_distrib.trainers.ps.handout import shards_can_fill

    for seed in range(200):
        rng = np.random.default_rng(seed)
        left, done, pending = list(sizes), {}, []  # pending: [steps, sure, worker or None, steps run]
        unguarded = guarded = 0
        while any(left) or pending:
            if any(left) and len(pending) < window:
                in_flight = sum(p[0] for p in pending)
                sure = shards_can_fill(sizes, done, in_flight, k)
                pending.append([k, sure, None, 0])
                unguarded, guarded = unguarded + sure, guarded + (not sure)
                continue
            waiting = [p for p in pending if p[2] is None]
            if waiting and (rng.random() < 0.6 or pending[0][2] is None):
                p = waiting[0]
                p[2] = int(rng.integers(len(sizes)))
                if p[1]:
                    assert left[p[2]] >= p[0], (seed, sizes, left, p)
                p[3] = min(p[0], left[p[2]])
                left[p[2]] -= p[3]
            else:
                steps, _, worker, ran = pending.pop(0)
                done[worker] = done.get(worker, 0) + ran
        assert done == {i: s for i, s in enumerate(sizes) if i in done} and sum(done.values()) == sum(sizes)
        if min(sizes) >= k * (window + 1):
            assert unguarded > guarded
