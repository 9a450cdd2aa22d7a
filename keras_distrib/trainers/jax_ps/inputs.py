"""The training data of a JAX ps fit, read by batch number: the chief hands out parts of an
epoch as ranges of batches, and every process must find the same batches under the same
numbers (the same epoch, seed and shuffle on every process).

One interface, `EpochInput`, four readers:

* `ArrayInput`: in-memory arrays; a part's rows are gathered by index (no pipeline).
* `IndexedInput`: a ``keras.utils.PyDataset``; batch ``b`` is ``py_dataset[order[b]]``.
* `RepeatedInput`: any of the others repeated, ``steps_per_epoch`` batches an epoch.
* `StreamInput`: everything else `keras_distrib.data` takes (a ``tf.data.Dataset``, files, a
  custom source): each process reads the epoch's stream of batches (a dataset's own shuffles
  re-seeded alike on every process, `keras_distrib.data.DatasetSource`) and skips the batches
  of parts other workers took, as ``Dataset.shard`` reads past other shards.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import numpy as np

from ... import data as kd_data
from ...data.pydataset import PyDatasetSource, standardize
from .._common import TrainerError

logger = logging.getLogger(__name__)


class EpochInput(Protocol):
    """An epoch of training data as numbered batches, the same on every process."""

    #: Batches in every epoch (None: endless, read only through `RepeatedInput`).
    num_batches: int | None
    #: Examples in every epoch, where known before it (the chief then checks its count).
    rows: int | None

    def sample(self) -> tuple[Any, ...]:
        """A batch to build the model's variables from."""
        ...

    def batches(self, epoch: int, seed: int, first: int, count: int) -> list[tuple[Any, ...]]:
        """Batches ``first .. first + count - 1`` of ``epoch`` (each ``(x, y[, sample_weight])``)."""
        ...


def batch_rows(batch: tuple[Any, ...]) -> int:
    """Examples in one batch: the leading size of its first array."""
    import jax

    return int(len(jax.tree_util.tree_leaves(batch)[0]))


def as_tuple(batch: Any) -> tuple[Any, ...]:
    """A batch as Keras' ``train_step`` takes it: ``(x, y[, sample_weight])``, or ``(x,)``."""
    return tuple(batch) if isinstance(batch, tuple) else (batch,)


@functools.lru_cache(maxsize=2)
def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of ``count`` rows or batches in ``epoch``: drawn from ``(seed, epoch)`` when
    ``shuffle``, the same on every process (cached: every part of the epoch reads it)."""
    return np.random.default_rng([seed, epoch]).permutation(count) if shuffle else np.arange(count)


@dataclass
class ArrayInput:
    """In-memory arrays: the epoch's order of rows is drawn from ``(seed, epoch)``."""

    arrays: tuple[Any, ...]
    rows: int
    batch_size: int
    shuffle: bool

    @property
    def num_batches(self) -> int:
        return -(-self.rows // self.batch_size)

    def sample(self) -> tuple[Any, ...]:
        return self._gather(np.arange(min(self.rows, 2)))

    def batches(self, epoch: int, seed: int, first: int, count: int) -> list[tuple[Any, ...]]:
        order = epoch_order(self.rows, seed, epoch, self.shuffle)
        rows = order[first * self.batch_size:(first + count) * self.batch_size]
        return [self._gather(rows[i:i + self.batch_size]) for i in range(0, len(rows), self.batch_size)]

    def _gather(self, rows: np.ndarray) -> tuple[Any, ...]:
        import jax

        return jax.tree_util.tree_map(lambda a: a[rows], self.arrays)


@dataclass
class IndexedInput:
    """A ``keras.utils.PyDataset``: batch ``b`` of an epoch is ``py_dataset[order[b]]``, the order
    permuted from ``(seed, epoch)`` when ``shuffle`` (as Keras' own ``fit`` permutes it)."""

    py_dataset: Any
    num_batches: int | None  # None: endless (read with steps_per_epoch, in index order)
    shuffle: bool
    rows: int | None = None

    def sample(self) -> tuple[Any, ...]:
        return as_tuple(standardize(self.py_dataset[0]))

    def batches(self, epoch: int, seed: int, first: int, count: int) -> list[tuple[Any, ...]]:
        order = np.arange(first + count) if self.num_batches is None else \
            epoch_order(self.num_batches, seed, epoch, self.shuffle)
        return [as_tuple(standardize(self.py_dataset[int(b)])) for b in order[first:first + count]]


@dataclass
class StreamInput:
    """A source read as one stream of batches per epoch (`keras_distrib.data.pipeline`, one shard).

    A reader keeps its place in the epoch it reads: parts handed out in order cost one pass;
    a part before the place (a dead worker's, handed out again) opens the epoch afresh.
    """

    source: Any
    batch_size: int | None
    shuffle: bool
    endless_ok: bool = False  # with steps_per_epoch: an endless stream is read on and on
    num_batches: int | None = 0
    rows: int | None = None
    _stream: Iterator[Any] | None = field(default=None, repr=False)
    _key: tuple[int, int] | None = field(default=None, repr=False)
    _place: int = 0

    def __post_init__(self) -> None:
        self.num_batches = self._count_batches()
        if not self.source.batched and self.source.num_examples is not None:
            self.rows = int(self.source.num_examples)

    def epoch(self, epoch: int, seed: int) -> Any:
        """The epoch's batches as a ``tf.data.Dataset`` (the same on every process)."""
        return kd_data.pipeline(self.source, 0, 1, batch_size=self.batch_size, shuffle=self.shuffle, seed=seed,
                                repeat=False, epoch=epoch)

    def _count_batches(self) -> int | None:
        import tensorflow as tf

        known = int(self.epoch(0, 0).cardinality())
        if known == tf.data.INFINITE_CARDINALITY:
            if self.endless_ok:
                return None
            raise TrainerError("the training data has no end (an infinite dataset: .repeat()) and steps_per_epoch is "
                               "not given. HINT: pass steps_per_epoch=..., or drop the .repeat() (every epoch is then "
                               "the whole data, exactly once).")
        if known >= 0:
            return known
        logger.info("the data has unknown size: counting its batches in one pass first "
                    "(tf.data.experimental.assert_cardinality(N) on the dataset skips this).")
        return int(self.epoch(0, 0).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))

    def sample(self) -> tuple[Any, ...]:
        return as_tuple(next(iter(self.epoch(0, 0).take(1).as_numpy_iterator())))

    def batches(self, epoch: int, seed: int, first: int, count: int) -> list[tuple[Any, ...]]:
        if self._key != (epoch, seed) or self._place > first or self._stream is None:
            self._stream, self._key, self._place = self.epoch(epoch, seed).as_numpy_iterator(), (epoch, seed), 0
        for _ in range(first - self._place):
            next(self._stream)
        self._place = first + count
        return [as_tuple(next(self._stream)) for _ in range(count)]


@dataclass
class RepeatedInput:
    """An input repeated, ``num_batches`` (``steps_per_epoch``) batches an epoch: epoch ``e`` is
    batches ``e * num_batches ...`` of the repeated data, whose pass ``p`` is epoch ``p`` of
    ``inner`` in its own order (an endless ``inner``: one pass, read on)."""

    inner: EpochInput
    num_batches: int
    rows: int | None = None

    def sample(self) -> tuple[Any, ...]:
        return self.inner.sample()

    def batches(self, epoch: int, seed: int, first: int, count: int) -> list[tuple[Any, ...]]:
        at, per_pass, out = epoch * self.num_batches + first, self.inner.num_batches, []
        while count:
            data_pass, batch = divmod(at, per_pass) if per_pass else (0, at)
            take = min(count, per_pass - batch) if per_pass else count
            out += self.inner.batches(data_pass, seed, batch, take)
            at, count = at + take, count - take
        return out


def epoch_input(source: Any, batch_size: int | None, shuffle: bool, steps_per_epoch: int | None = None) -> EpochInput:
    """The reader for a `keras_distrib.data` source (see the module docstring); ``steps_per_epoch``:
    epochs of that many batches of the data repeated."""
    inner = _reader(source, batch_size, shuffle, endless_ok=steps_per_epoch is not None)
    if steps_per_epoch is None:
        return inner
    if int(steps_per_epoch) < 1:
        raise TrainerError(f"steps_per_epoch={steps_per_epoch!r}. HINT: pass a whole number >= 1, or leave it out "
                           "(every epoch is then the whole data, exactly once).")
    return RepeatedInput(inner, int(steps_per_epoch))


def _reader(source: Any, batch_size: int | None, shuffle: bool, endless_ok: bool) -> EpochInput:
    arrays = source.rows_in_memory()
    if arrays is not None:
        import jax

        arrays = jax.tree_util.tree_map(np.asarray, as_tuple(arrays))  # tf.Tensors too: gathered by numpy
        return ArrayInput(arrays, int(source.num_examples), int(batch_size or 32), shuffle)
    if isinstance(source, PyDatasetSource):
        if source.num_examples is None and not endless_ok:
            raise TrainerError("the PyDataset has no end (num_batches None) and steps_per_epoch is not given. HINT: "
                               "pass steps_per_epoch=..., or give it __len__ (every epoch is then the whole data, "
                               "exactly once).")
        return IndexedInput(source.py_dataset, source.num_examples, shuffle)
    return StreamInput(source, None if source.batched else int(batch_size or 32), shuffle, endless_ok)
