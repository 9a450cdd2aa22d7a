"""A Keras ``PyDataset`` (``keras.utils.PyDataset``, also ``keras.utils.Sequence``):
batch ``b`` to worker ``b % k``, read by Python in the process that builds the dataset.

Where its Python runs: in all-reduce every worker runs SCRIPT and reads its own batches
from its own copy of the object; in the parameter-server layouts the datasets run on the
workers but the ``tf.data.Dataset.from_generator`` inside calls back into the chief's
Python (measured on TF 2.21: the batches of every worker were read in the chief's
process), so the chief reads every worker's batches and TensorFlow ships them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Iterator

from . import _private_apis as private
from .base import BaseSource, InputError
from .policy import Order, shard_indices, shard_seed

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

logger = logging.getLogger(__name__)

#: Batches read up front to learn the element spec (Keras reads 2 too).
SPEC_BATCHES = 2

# Keras' enqueuer keeps its datasets in one process-wide table; two enqueued shards read at
# once in one process (the ps layouts: the chief serves every worker's shard) mixed their
# batches (CI: an epoch's id sum wrong, or a batch missing). One enqueued stream at a time;
# any other reads its batches in order on the calling thread.
_ENQUEUER = threading.Lock()


def is_py_dataset(data: Any) -> bool:
    """True for a ``keras.utils.PyDataset`` (without importing Keras when it is not loaded)."""
    import sys

    keras = sys.modules.get("keras")
    if keras is None:
        return False
    return isinstance(data, keras.utils.PyDataset)


def standardize(batch: Any) -> Any:
    """Keras' rule for a PyDataset batch: a dict, ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sw)``."""
    import numpy as np

    if isinstance(batch, list):
        batch = tuple(batch)
    if isinstance(batch, tuple) and len(batch) == 1 and not isinstance(batch[0], (tuple, list)):
        batch = batch[0]
    if isinstance(batch, tuple) and len(batch) not in (2, 3):
        raise InputError(
            f"PyDataset.__getitem__ returned a tuple of {len(batch)} parts. HINT: return x, (x, y) or "
            "(x, y, sample_weight), as keras' model.fit expects."
        )
    if not isinstance(batch, (tuple, dict)) and not hasattr(batch, "shape"):
        batch = np.asarray(batch)
    return batch


class _Shard:
    """The batches of one shard and pass, as a PyDataset for Keras' enqueuer."""

    def __init__(self, base: Any, indices: Any, count: int | None) -> None:
        self.base, self.indices, self.count = base, indices, count
        # Threads only: see PyDatasetSource on use_multiprocessing.
        self.workers, self.use_multiprocessing = base.workers, False
        self.max_queue_size = base.max_queue_size

    @property
    def num_batches(self) -> int | None:
        return self.count

    def __len__(self) -> int:
        return self.count if self.count is not None else 2**62

    def __getitem__(self, j: int) -> Any:
        return self.base[self.indices[j]] if self.count is not None else self.base[self.indices(j)]


class PyDatasetSource(BaseSource):
    """A ``keras.utils.PyDataset``, dealt by batch index (batch ``b`` to worker ``b % k``).

    Elements are its batches (``batched``), so ``batch_size`` does not apply: in all-reduce
    a batch is the global batch, sliced over the replicas. ``num_examples`` is its ``num_batches`` (None: endless,
    ``steps_per_epoch`` needed). Shuffling (fit's ``shuffle``) permutes each worker's batch
    indices, seeded per shard, epoch and pass. ``workers`` and ``max_queue_size`` fetch each
    shard ahead in threads as Keras does (one pool per shard: the chief of a ps layout reads
    every worker's shard, each with its own pool). ``use_multiprocessing=True`` is run with
    threads too, with a warning: Keras' pool forks the process, and a fork of a process
    running TensorFlow's distributed runtime deadlocked (all-reduce, 3 workers: the forked
    readers returned no batch in 12 minutes).
    ``on_epoch_begin``/``on_epoch_end`` are called around each training epoch, in every
    process that holds the object (all-reduce: every worker, which slices batch ``b``, so it must be the
    same batch on every worker: reorder it in ``on_epoch_end`` with a seeded generator).
    """

    batched = True

    def __init__(self, py_dataset: Any) -> None:
        self.py_dataset = py_dataset
        try:
            n = py_dataset.num_batches
        except NotImplementedError:
            raise InputError(
                f"the PyDataset {type(py_dataset).__name__} has neither __len__ nor num_batches. "
                "HINT: define __len__ (or the num_batches property; None for an endless one)."
            ) from None
        self.num_examples: int | None = None if n is None else int(n)
        if self.num_examples == 0:
            raise InputError(f"the PyDataset {type(py_dataset).__name__} has 0 batches. HINT: give it data.")
        if py_dataset.use_multiprocessing:
            logger.warning(
                f"the PyDataset {type(py_dataset).__name__} has use_multiprocessing=True; keras_distrib reads it "
                f"with {py_dataset.workers} threads instead (forking a process that runs TensorFlow's distributed "
                "runtime deadlocks). HINT: set use_multiprocessing=False, or do the heavy work in tf.data (map with "
                "num_parallel_calls)."
            )
        self._spec: Any = None
        self._passes: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()

    @property
    def element_spec(self) -> Any:
        """The TensorSpecs of a batch (batch dimension and any varying one left open)."""
        if self._spec is None:
            self._spec = _spec_of([standardize(self.py_dataset[i]) for i in range(min(SPEC_BATCHES, self.num_examples or SPEC_BATCHES))])
        return self._spec

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        return self.epoch_elements(index, num_shards, Order())

    def epoch_elements(self, index: int, num_shards: int, order: Order) -> "tf.data.Dataset":
        import tensorflow as tf

        seed = shard_seed(order.seed or 0, index)

        def batches(epoch: Any) -> Iterator[Any]:
            return self._batches(index, num_shards, int(epoch), order.shuffle, int(seed))

        return tf.data.Dataset.from_generator(batches, args=(tf.cast(order.epoch, tf.int64),),
                                              output_signature=self.element_spec)

    def _batches(self, index: int, num_shards: int, epoch: int, shuffle: bool, seed: int) -> Iterator[Any]:
        import numpy as np

        with self._lock:  # a repeated dataset calls again for each pass: each gets a new order
            key = (index, num_shards, epoch)
            passes = self._passes[key] = self._passes.get(key, -1) + 1
        if self.num_examples is None:
            view = _Shard(self.py_dataset, lambda j: index + j * num_shards, None)
        else:
            indices = list(shard_indices(self.num_examples, index, num_shards))
            if shuffle:
                np.random.default_rng([seed % 2**32, epoch % 2**32, passes]).shuffle(indices)
            view = _Shard(self.py_dataset, indices, len(indices))
        enqueued = self.py_dataset.workers > 1 and _ENQUEUER.acquire(blocking=False)
        try:
            if enqueued:
                stream = private.enqueued_batches(view, view.count)
            else:
                stream = (view[j] for j in (range(view.count) if view.count is not None else itertools.count()))
            for batch in stream:
                yield own_copy(standardize(batch))
        finally:
            if enqueued:
                _ENQUEUER.release()

    def on_epoch_begin(self, epoch: int) -> None:
        self.py_dataset.on_epoch_begin()

    def on_epoch_end(self, epoch: int) -> None:
        self.py_dataset.on_epoch_end()


def own_copy(batch: Any) -> Any:
    """The batch's arrays copied, so nothing downstream shares memory with the PyDataset's own
    arrays. Seen without it: batches that are views (``self.y[s]``), sliced per replica in
    all-reduce on 2 workers, came back with ids near 13,000 for 0..448 from the second epoch
    on (3 runs of 3); with the copy, exact (TensorFlow can wrap an aligned NumPy array
    without a copy)."""
    import numpy as np
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else a, batch)


def _spec_of(batches: list[Any]) -> Any:
    """One TensorSpec nest covering ``batches`` (dimensions that differ become None)."""
    import numpy as np
    import tensorflow as tf

    def spec(*leaves: Any) -> Any:
        arrays = [np.asarray(v) for v in leaves]
        if arrays[0].ndim == 0:
            raise InputError("a PyDataset batch holds a scalar. HINT: every part of a batch needs a batch dimension.")
        dims = [None] + [d if all(a.shape[i] == d for a in arrays) else None
                         for i, d in enumerate(arrays[0].shape) if i > 0]
        dtype = tf.string if arrays[0].dtype.kind in "SUO" else tf.as_dtype(arrays[0].dtype)
        return tf.TensorSpec(dims, dtype)

    try:
        return tf.nest.map_structure(spec, *batches)
    except (ValueError, TypeError) as e:
        if isinstance(e, InputError):
            raise
        raise InputError(f"the PyDataset's first batches differ in structure ({e}). HINT: return the same "
                         "structure (x, y[, sample_weight]) from every __getitem__.") from None
