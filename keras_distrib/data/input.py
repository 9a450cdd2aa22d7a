"""What the trainers call: `as_source` (the user's input, once, as a `Source`) and
`pipeline` (one worker's dataset of one epoch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .arrays import ArraySource
from .base import BaseSource, CustomSource, Source
from .policy import SHUFFLE_BUFFER, Order
from .tfdata import DatasetSource

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf


def as_source(data: Any) -> Source:
    """What users pass to ``fit`` (arrays, ``(x, y)``, a Dataset, a Source) as a `Source`."""
    if isinstance(data, BaseSource):
        return data
    if hasattr(data, "shard") and hasattr(data, "num_examples"):
        return CustomSource(data)
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
    epoch: Any = 0,
    shuffle_buffer: int = SHUFFLE_BUFFER,
) -> "tf.data.Dataset":
    """Per-worker input pipeline of one epoch: shard -> order -> (repeat) -> batch -> finish.

    ``epoch`` (int or int64 tensor) varies the shuffle order from epoch to epoch; each
    epoch's dataset is finite unless ``repeat``. How the shard is ordered is the source's
    (`Source.epoch_elements`): a per-shard shuffle by default, a `DatasetSource` its own
    shuffles, seeded identically on every worker.
    """
    import tensorflow as tf

    order = Order(shuffle=shuffle, seed=seed, epoch=epoch, buffer=shuffle_buffer)
    ds = source.epoch_elements(index, num_shards, order)
    if repeat:
        ds = ds.repeat()
    if not source.batched:
        if batch_size is None:
            raise ValueError("batch_size is required for unbatched data (arrays, files).")
        ds = ds.batch(batch_size, drop_remainder=False)
    ds = source.finish_batches(ds)
    return ds.prefetch(tf.data.AUTOTUNE)
