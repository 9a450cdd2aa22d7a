"""Data each worker loads itself: ``load_fn(rank, num_workers) -> arrays``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .base import BaseSource
from .policy import check_index, leading_len, map_nest

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf


@dataclass
class SelfLoadedSource(BaseSource):
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

        check_index(index, num_shards)
        arrays = self.load_fn(index, num_shards)
        if not self.random_slice:
            return arrays
        perm = np.random.default_rng(self.seed).permutation(leading_len(arrays))
        mine = np.sort(perm[index::num_shards])
        return map_nest(lambda a: np.asarray(a)[mine], arrays)

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(self.arrays_for(index, num_shards))


def self_loading(
    load_fn: Callable[[int, int], Any], *, seed: int = 0, random_slice: bool = True,
    num_examples: int | None = None,
) -> SelfLoadedSource:
    """Data that each worker loads itself; see `SelfLoadedSource`."""
    return SelfLoadedSource(load_fn, seed=seed, random_slice=random_slice, num_examples=num_examples)
