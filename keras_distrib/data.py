"""Sharding training data by worker rank.

Policy (the same in both layouts and in the helpers below):

* Element ``i`` goes to shard ``i % num_shards``. Shards are disjoint, their union is the
  whole data, and with ``n`` elements over ``k`` shards the first ``n % k`` shards hold one
  extra element. Nothing is dropped: batches are formed with ``drop_remainder=False``.
* Files are dealt the same way (file ``i`` to shard ``i % k``); fewer files than shards is
  an error because some worker would get no data.
* Shuffling is seeded per shard (``seed + shard``) so workers draw different orders,
  reproducibly.

`Source` objects describe data without materialising it per worker; the trainers ask
``source.shard(index, count)`` once per worker (a ParameterServerStrategy worker gets its
own dataset function with its index baked in, see ``trainers/ps_async.py``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

__all__ = [
    "Source",
    "ArraySource",
    "DatasetSource",
    "FileSource",
    "SelfLoadedSource",
    "as_source",
    "shard_sizes",
    "shard_arrays",
    "shard_dataset",
    "shard_files",
    "self_loading",
    "shard_seed",
    "steps_for",
    "worker_rank",
]


def shard_sizes(n: int, num_shards: int) -> list[int]:
    """Sizes of the ``num_shards`` shards of ``n`` elements (first ``n % k`` get one more)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    base, extra = divmod(n, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def steps_for(num_examples: int, batch_size: int) -> int:
    """Batches needed to see every one of ``num_examples`` once (last batch may be short)."""
    return max(1, math.ceil(num_examples / batch_size))


def shard_seed(seed: int | None, index: int) -> int | None:
    """Per-shard shuffle seed: distinct per worker, reproducible for a given ``seed``."""
    return None if seed is None else int(seed) + int(index)


def _check_index(index: int, num_shards: int) -> None:
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")


def shard_arrays(arrays: Any, index: int, num_shards: int) -> Any:
    """Shard ``index`` of a nest of equally long arrays (``x``, ``(x, y)``, dicts...)."""
    _check_index(index, num_shards)
    return _map(lambda a: a[index::num_shards], arrays)


def shard_dataset(dataset: "tf.data.Dataset", index: int, num_shards: int) -> "tf.data.Dataset":
    """Shard ``index`` of a dataset's elements (element ``i`` goes to ``i % num_shards``)."""
    _check_index(index, num_shards)
    return dataset.shard(num_shards, index)


def shard_files(files: Sequence[str], index: int, num_shards: int) -> list[str]:
    """The files of shard ``index`` (sorted first, so every worker deals the same list)."""
    files = sorted(files)
    if len(files) < num_shards:
        raise ValueError(
            f"{len(files)} files cannot feed {num_shards} workers: each worker needs at "
            "least one file. HINT: split the data into more files or shard by example."
        )
    _check_index(index, num_shards)
    return files[index::num_shards]


def worker_rank() -> tuple[int, int]:
    """(rank, number of workers) of this process from TF_CONFIG; (0, 1) without it."""
    cfg = json.loads(os.environ.get("TF_CONFIG") or "{}")
    cluster, task = cfg.get("cluster", {}), cfg.get("task", {})
    workers = len(cluster.get("worker", [])) or 1
    rank = int(task.get("index", 0)) if task.get("type") == "worker" else 0
    return rank, workers


class Source(Protocol):
    """Something the trainers can split into per-worker datasets."""

    #: Number of elements (examples, or batches when ``batched``); None if unknown.
    num_examples: int | None
    #: True if elements are already batches (the trainer then does not batch again).
    batched: bool

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        """The dataset of shard ``index`` out of ``num_shards``."""
        ...


def _map(fn: Callable[[Any], Any], nest: Any) -> Any:
    """map over a nest of tuples/lists/dicts of arrays (no TensorFlow import needed)."""
    if isinstance(nest, dict):
        return {k: _map(fn, v) for k, v in nest.items()}
    if isinstance(nest, (tuple, list)):
        return type(nest)(_map(fn, v) for v in nest)
    return fn(nest)


def _flatten(nest: Any) -> list[Any]:
    out: list[Any] = []
    _map(out.append, nest)
    return out


def _leading_len(arrays: Any) -> int:
    lengths = {len(a) for a in _flatten(arrays) if a is not None}
    if len(lengths) != 1:
        raise ValueError(f"arrays have different lengths: {sorted(lengths)}")
    return lengths.pop()


@dataclass
class ArraySource:
    """In-memory arrays, e.g. ``(x, y)`` or ``(x, y, sample_weight)``."""

    arrays: Any
    batched: bool = False

    def __post_init__(self) -> None:
        self.num_examples: int | None = _leading_len(self.arrays)

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(shard_arrays(self.arrays, index, num_shards))


@dataclass
class DatasetSource:
    """A ``tf.data.Dataset``; ``batched=True`` (Keras' convention) shards whole batches."""

    dataset: Any
    batched: bool = True

    def __post_init__(self) -> None:
        import tensorflow as tf

        card = int(self.dataset.cardinality())
        self.num_examples: int | None = card if card >= 0 else None
        if card == tf.data.INFINITE_CARDINALITY:
            self.num_examples = None

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        dataset = self.dataset
        if tf.inside_function():
            # Traced on the parameter-server chief for a remote worker: an eager dataset's
            # variant lives on the chief and cannot be sent, so rebuild the dataset from
            # its graph inside the function (what tf.distribute does for its own inputs).
            variant = self._variant_creator()()
            dataset = tf.data.experimental.from_variant(variant, self.dataset.element_spec)
        return shard_dataset(dataset, index, num_shards)

    def _variant_creator(self) -> Any:
        if not hasattr(self, "_creator"):
            self._creator = self.dataset._trace_variant_creation()  # private TF API, see shard()
        return self._creator


@dataclass
class FileSource:
    """Files dealt to workers; ``reader(path) -> Dataset`` of examples (TFRecord default)."""

    files: Sequence[str]
    reader: Callable[[Any], Any] | None = None
    num_examples: int | None = None
    batched: bool = False

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        reader = self.reader or tf.data.TFRecordDataset
        files = tf.data.Dataset.from_tensor_slices(shard_files(self.files, index, num_shards))
        return files.interleave(reader, cycle_length=1)


@dataclass
class SelfLoadedSource:
    """Each worker loads its own data with ``load_fn(rank, num_workers) -> arrays``.

    With ``random_slice=True`` the loaded arrays are treated as a pool shared by all
    workers and worker ``rank`` keeps a random slice of it: a permutation drawn with
    ``seed`` (identical on every worker) dealt by rank, so slices are disjoint and cover
    the pool. With ``random_slice=False`` ``load_fn`` must already return only the
    worker's own part.

    In the parameter-server layouts the worker processes run no Python, so the chief calls
    ``load_fn(rank, num_workers)`` for each worker rank and ships each result to its worker.
    """

    load_fn: Callable[[int, int], Any]
    seed: int = 0
    random_slice: bool = True
    num_examples: int | None = None
    batched: bool = False

    def arrays_for(self, index: int, num_shards: int) -> Any:
        import numpy as np

        _check_index(index, num_shards)
        arrays = self.load_fn(index, num_shards)
        if not self.random_slice:
            return arrays
        perm = np.random.default_rng(self.seed).permutation(_leading_len(arrays))
        mine = np.sort(perm[index::num_shards])
        return _map(lambda a: np.asarray(a)[mine], arrays)

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(self.arrays_for(index, num_shards))


def self_loading(
    load_fn: Callable[[int, int], Any], *, seed: int = 0, random_slice: bool = True,
    num_examples: int | None = None,
) -> SelfLoadedSource:
    """Data that each worker loads itself; see `SelfLoadedSource`."""
    return SelfLoadedSource(load_fn, seed=seed, random_slice=random_slice, num_examples=num_examples)


def as_source(data: Any) -> Source:
    """Wrap what users pass to ``fit`` (arrays, ``(x, y)``, Dataset, Source) as a Source."""
    if hasattr(data, "shard") and hasattr(data, "num_examples"):
        return data
    try:
        import tensorflow as tf

        if isinstance(data, tf.data.Dataset):
            return DatasetSource(data)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(data, list):
        data = tuple(data)
    return ArraySource(data)


def pipeline(
    source: Source,
    index: int,
    num_shards: int,
    *,
    batch_size: int | None,
    shuffle: bool,
    seed: int | None,
    repeat: bool,
    shuffle_buffer: int = 10_000,
) -> "tf.data.Dataset":
    """Per-worker input pipeline: shard -> shuffle (per-shard seed) -> repeat -> batch."""
    import tensorflow as tf

    ds = source.shard(index, num_shards)
    if shuffle:
        ds = ds.shuffle(shuffle_buffer, seed=shard_seed(seed, index), reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    if not source.batched:
        if batch_size is None:
            raise ValueError("batch_size is required for unbatched data (arrays, files).")
        ds = ds.batch(batch_size, drop_remainder=False)
    return ds.prefetch(tf.data.AUTOTUNE)
