"""The sharding policy, in one place: which elements, files and batches each worker gets.

* Element ``i`` goes to shard ``i % num_shards``. Shards are disjoint, their union is the
  whole data, and with ``n`` elements over ``k`` shards the first ``n % k`` shards hold one
  extra element. Nothing is dropped: batches are formed with ``drop_remainder=False``.
* Files are dealt the same way (file ``i`` of the sorted list to shard ``i % k``); fewer
  files than shards is an error because some worker would get no data.
* Batches of a source that is already batched (a batched ``tf.data.Dataset``, a Keras
  ``PyDataset``) are dealt the same way in the parameter-server layouts: batch ``b`` to
  shard ``b % k``. All-reduce reads them as one shard and cuts every batch into one slice
  per replica (the input's batch is the global batch: trainers/allreduce.py).
* Shuffling is seeded per shard and epoch (`Order`): workers draw different orders,
  reproducibly, and each epoch a new one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

#: Default shuffle buffer of the per-shard shuffle (elements).
SHUFFLE_BUFFER = 10_000


def shard_sizes(n: int, num_shards: int) -> list[int]:
    """Sizes of the ``num_shards`` shards of ``n`` elements (first ``n % k`` get one more)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    base, extra = divmod(n, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def shard_indices(n: int, index: int, num_shards: int) -> range:
    """The element (or batch) indices of shard ``index`` out of ``n``: ``index, index + k, ...``."""
    check_index(index, num_shards)
    return range(index, n, num_shards)


def steps_for(num_examples: int, batch_size: int) -> int:
    """Batches needed to see every one of ``num_examples`` once (last batch may be short)."""
    return max(1, math.ceil(num_examples / batch_size))


def steps_for_shards(num_examples: int | None, num_shards: int, batch_size: int | None) -> list[int] | None:
    """Batches of each shard in one epoch (``batch_size`` None: elements are batches)."""
    if num_examples is None:
        return None
    sizes = shard_sizes(num_examples, num_shards)
    if batch_size is None:
        return sizes
    return [math.ceil(s / batch_size) for s in sizes]


def shard_rows(n: int, num_shards: int, *, epoch: int, shuffle: bool, seed: int | None) -> list[Any]:
    """Each shard's row numbers (rows ``j, j + k, ...``) in the order ``epoch`` trains them:
    a permutation drawn from (seed, epoch, shard) with ``shuffle``, else in order."""
    import numpy as np

    rows = [np.asarray(shard_indices(n, j, num_shards), dtype=np.int64) for j in range(num_shards)]
    if shuffle:
        rows = [np.random.default_rng([int(seed or 0), int(epoch), j]).permutation(r) for j, r in enumerate(rows)]
    return rows


def tail_part_limit(left: int, k: int, workers: int, unit: int = 1) -> int:
    """The most steps the next part of an epoch may hold with ``left`` steps to go: K, and
    within the last ``2 * workers * K`` steps about ``left / (2 * workers)`` (guided
    self-scheduling), so the last parts are small and a slow worker holding one delays the
    epoch's end by little; a multiple of ``unit`` (at least one). One worker has no one to
    wait for: K throughout."""
    target = left if workers <= 1 else -(-left // (2 * workers))
    return max(unit, min(k - k % unit, -(-target // unit) * unit))


def epoch_parts(rows: Sequence[Any], batch_size: int, k: int, first_step: int = 0,
                num_steps: int | None = None) -> Iterator[tuple[int, Any]]:
    """The parts of an epoch handed out dynamically in the parameter-server layouts:
    ``(steps, row numbers)`` for each, up to ``k`` consecutive steps of one shard (each
    shard batched on its own, its last batch maybe short, as with fixed shards), the
    shards taking turns. The sequence is fixed per epoch, so steps ``first_step`` to
    ``first_step + num_steps`` (a resumed epoch) are the same rows whoever runs them.
    Near the end the parts shrink (`tail_part_limit`)."""
    sizes = [-(-len(r) // batch_size) for r in rows]
    sequence = []  # (shard, step in the shard), in the order they are handed out
    for start in range(0, max(sizes, default=0), k):
        for j, size in enumerate(sizes):
            sequence += [(j, s) for s in range(start, min(start + k, size))]
    at = first_step
    end = len(sequence) if num_steps is None else min(first_step + num_steps, len(sequence))
    while at < end:
        shard, step = sequence[at]
        n, limit = 1, tail_part_limit(end - at, k, len(rows))
        while n < limit and at + n < end and sequence[at + n][0] == shard:
            n += 1
        yield n, rows[shard][step * batch_size:(step + n) * batch_size]
        at += n


def shard_seed(seed: int | None, index: int) -> int | None:
    """Per-shard shuffle seed: distinct per worker, reproducible for a given ``seed``."""
    return None if seed is None else int(seed) + int(index)


def check_index(index: int, num_shards: int) -> None:
    """ValueError unless ``0 <= index < num_shards``."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")


def map_nest(fn: Callable[[Any], Any], nest: Any) -> Any:
    """map over a nest of tuples/lists/dicts of arrays (no TensorFlow import needed)."""
    if isinstance(nest, dict):
        return {k: map_nest(fn, v) for k, v in nest.items()}
    if isinstance(nest, (tuple, list)):
        return type(nest)(map_nest(fn, v) for v in nest)
    return fn(nest)


def flatten_nest(nest: Any) -> list[Any]:
    """The leaves of a nest, in `map_nest` order."""
    out: list[Any] = []
    map_nest(out.append, nest)
    return out


def leading_len(arrays: Any) -> int:
    """The common first dimension of a nest of arrays (ValueError if they differ)."""
    lengths = {len(a) for a in flatten_nest(arrays) if a is not None}
    if len(lengths) != 1:
        raise ValueError(f"arrays have different lengths: {sorted(lengths)}")
    return lengths.pop()


def shard_arrays(arrays: Any, index: int, num_shards: int) -> Any:
    """Shard ``index`` of a nest of equally long arrays (``x``, ``(x, y)``, dicts...)."""
    check_index(index, num_shards)
    return map_nest(lambda a: a[index::num_shards], arrays)


def shard_dataset(dataset: "tf.data.Dataset", index: int, num_shards: int) -> "tf.data.Dataset":
    """Shard ``index`` of a dataset's elements (element ``i`` goes to ``i % num_shards``)."""
    check_index(index, num_shards)
    return dataset.shard(num_shards, index)


def shard_files(files: Sequence[str], index: int, num_shards: int) -> list[str]:
    """The files of shard ``index`` (sorted first, so every worker deals the same list)."""
    files = sorted(files)
    if len(files) < num_shards:
        raise ValueError(
            f"{len(files)} files cannot feed {num_shards} workers: each worker needs at "
            "least one file. HINT: split the data into more files or shard by example."
        )
    check_index(index, num_shards)
    return files[index::num_shards]


def worker_rank() -> tuple[int, int]:
    """(rank, number of workers) of this process, from what the launcher passed (contract.py)."""
    from .. import contract

    if not contract.in_job(os.environ):
        return 0, 1
    job, index = contract.read_task(os.environ)
    workers = len(contract.read_tf_cluster(os.environ).get("worker", [])) or 1
    return (index if job == "worker" else 0), workers


@dataclass(frozen=True)
class Order:
    """The order the pipeline asks of one epoch of a shard.

    ``shuffle``: draw a new order; ``seed``: fit's seed (None: 0); ``epoch``: an int or an
    int64 tensor (the ps layouts trace it once); ``buffer``: the shuffle buffer.
    """

    shuffle: bool = False
    seed: int | None = None
    epoch: Any = 0
    buffer: int = SHUFFLE_BUFFER

    def apply(self, dataset: "tf.data.Dataset", index: int) -> "tf.data.Dataset":
        """``dataset`` (shard ``index``'s elements) shuffled per shard and epoch, if asked."""
        import tensorflow as tf

        if not self.shuffle:
            return dataset
        if tf.inside_function():
            # A tensor seed under a global seed of 0 (keras.utils.set_random_seed(0)) makes
            # tf.data compare the tensor as a Python bool; this trace's graph needs no seed.
            tf.compat.v1.get_default_graph().seed = None
        base = tf.constant(shard_seed(self.seed or 0, index) * 1_000_003, tf.int64)
        return dataset.shuffle(self.buffer, seed=base + tf.cast(self.epoch, tf.int64), reshuffle_each_iteration=True)
