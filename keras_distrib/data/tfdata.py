"""A ``tf.data.Dataset``, rebuilt on every worker and sharded by element (or batch)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _private_apis as private
from .base import BaseSource
from .policy import Order, shard_dataset, shard_sizes

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

logger = logging.getLogger(__name__)


@dataclass
class DatasetSource(BaseSource):
    """A ``tf.data.Dataset``, sharded by element (whole batches when it is batched).

    ``batched``: None = read it from the pipeline (a final ``batch``/``padded_batch``...).
    Every worker rebuilds the dataset from its graph with each shuffle's seeds replaced by
    ``(seed, seed2 + epoch)``: all workers then draw the SAME order, so the shards (element
    ``i`` to worker ``i % k``) are disjoint and complete in every epoch, and
    ``reshuffle_each_iteration`` gives a new order each epoch. ``seed`` None: fit's ``seed``
    (0 if fit has none); a seed given here is kept. The pipeline does not shuffle it again:
    its own shuffles decide its order.
    """

    dataset: Any
    batched: bool | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        card = int(self.dataset.cardinality())
        self.num_examples: int | None = card if card >= 0 else None  # INFINITE and UNKNOWN are < 0
        self._graph = None
        self._fns: dict[int, Any] = {}
        if self.batched is None:
            self.batched = private.ends_with_batch(self._graph_def())

    def shard_sizes(self, num_shards: int) -> list[int] | None:
        """Known only where tf.data knows the size (not a size counted in one pass: a random
        ``filter`` may keep another number of elements every epoch)."""
        if self.batched or int(self.dataset.cardinality()) < 0:
            return None
        return shard_sizes(int(self.dataset.cardinality()), num_shards)

    def runs_python(self) -> bool:
        """True if its elements come from Python in this process (``from_generator``,
        ``tf.py_function``), wherever the dataset is rebuilt."""
        return private.runs_python(self._graph_def())

    def dataset_of_known_size(self) -> "tf.data.Dataset | None":
        return self.dataset if self.num_examples and not self.runs_python() else None

    def count_unknown_size(self) -> bool:
        """Learn the size of a dataset of unknown size (a TFRecord file, a ``filter``) by one pass
        over it, as Keras' ``fit`` learns it in its first epoch; False for an infinite one."""
        import tensorflow as tf

        if self.num_examples is not None or int(self.dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
            return False
        what = "batches" if self.batched else "elements"
        logger.info(f"the data has unknown size: counting its {what} in one pass first "
                    "(tf.data.experimental.assert_cardinality(N) on the dataset skips this).")
        started = time.monotonic()
        self.num_examples = int(self.dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
        logger.info(f"counted {self.num_examples} {what} in {time.monotonic() - started:.1f} s.")
        return True

    def _graph_def(self) -> Any:
        if self._graph is None:
            self._graph = private.dataset_graph_def(self.dataset)
        return self._graph

    def shard(self, index: int, num_shards: int, epoch: Any = 0) -> "tf.data.Dataset":
        return self.epoch_elements(index, num_shards, Order(epoch=epoch))

    def epoch_elements(self, index: int, num_shards: int, order: Order) -> "tf.data.Dataset":
        import tensorflow as tf

        seed = self.seed if self.seed is not None else (order.seed or 0)
        variant = self._variant_fn(int(seed))(tf.cast(order.epoch, tf.int64))
        dataset = tf.data.experimental.from_variant(variant, self.dataset.element_spec)
        return shard_dataset(dataset, index, num_shards)

    def _variant_fn(self, seed: int) -> Any:
        if seed not in self._fns:
            graph, output = private.seeded_graph(self._graph_def(), seed)
            self._fns[seed] = private.function_from_graph_def(graph, [private.EPOCH_INPUT + ":0"], output)
        return self._fns[seed]
