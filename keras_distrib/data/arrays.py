"""In-memory arrays: element ``i`` (row ``i`` of every array) to worker ``i % k``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .base import BaseSource
from .policy import leading_len, map_nest, shard_arrays, shard_sizes

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf


@dataclass
class ArraySource(BaseSource):
    """In-memory arrays, e.g. ``(x, y)`` or ``(x, y, sample_weight)``, dicts and lists of them."""

    arrays: Any
    batched: bool = False

    def __post_init__(self) -> None:
        self.num_examples: int | None = leading_len(self.arrays)

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(shard_arrays(self.arrays, index, num_shards))

    def shard_sizes(self, num_shards: int) -> list[int] | None:
        return None if self.batched else shard_sizes(self.num_examples, num_shards)

    def rows_in_memory(self) -> Any | None:
        return None if self.batched or not self.num_examples else self.arrays

    def split(self, at: int) -> tuple["ArraySource", "ArraySource"]:
        """(the first ``at`` rows, the rest), as Keras' ``validation_split`` cuts them."""
        first = map_nest(lambda a: None if a is None else a[:at], self.arrays)
        second = map_nest(lambda a: None if a is None else a[at:], self.arrays)
        return ArraySource(first, self.batched), ArraySource(second, self.batched)
