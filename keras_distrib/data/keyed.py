"""Keyed inputs for order-preserving predict: ``(keys, x)`` elements of any input kind.

Every example gets a key ``(file, batch, position)`` (three int64 columns) before it is
sharded, so predictions can be put back in the input's order (trainers/ordered.py). The
input kind is read here, once, as `as_source` reads it for fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .arrays import ArraySource
from .base import BaseSource, InputError
from .files import FileSource
from .policy import map_nest, shard_files
from .pydataset import is_py_dataset
from .tfdata import DatasetSource

KEY_COLUMNS = 3


def model_input(element: Any) -> Any:
    """Keras' rule for what ``predict`` feeds the model: ``x`` of ``(x, y[, sw])``, else the element."""
    if isinstance(element, tuple) and 1 <= len(element) <= 3:
        return element[0]
    return element


def _keys(major: Any, middle: Any, minor: Any) -> Any:
    import tensorflow as tf

    cols = [tf.cast(c, tf.int64) for c in (major, middle, minor)]
    return tf.stack(cols, axis=-1)


def _keyed_elements(ds: Any, batched: bool, major: Any = 0) -> Any:
    """``(keys, x)`` elements of ``ds`` (see the module docstring)."""
    import tensorflow as tf

    def unbatched(i: Any, element: Any) -> Any:
        return _keys(major, 0, i), model_input(element)

    def batch(b: Any, element: Any) -> Any:
        x = model_input(element)
        n = tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0]
        return _keys(tf.fill([n], tf.cast(major, tf.int64)), tf.fill([n], b), tf.range(n)), x

    return ds.enumerate().map(batch if batched else unbatched)


@dataclass
class KeyedFileSource(BaseSource):
    """A FileSource whose elements are ``(keys, x)``; files dealt as `keras_distrib.data` does."""

    files: Sequence[str]
    reader: Callable[[Any], Any] | None
    num_examples: int | None
    batched: bool

    def shard(self, index: int, num_shards: int) -> Any:
        import tensorflow as tf

        reader = self.reader or tf.data.TFRecordDataset
        mine = shard_files(self.files, index, num_shards)
        order = [index + j * num_shards for j in range(len(mine))]  # position in sorted(files)
        files = tf.data.Dataset.from_tensor_slices((np.asarray(order, np.int64), list(mine)))
        return files.interleave(lambda f, path: _keyed_elements(reader(path), self.batched, major=f), cycle_length=1)


def keyed_source(x: Any, *, batch_size: int, steps: int | None) -> Any:
    """The `keras_distrib.data` Source of ``(keys, x)`` elements for ``predict(x)``.

    ``steps`` keeps the first ``steps`` batches of ``batch_size`` rows (of a batched
    dataset: its first ``steps`` batches), as Keras' ``predict(steps=...)`` does.
    """
    import tensorflow as tf

    if not isinstance(x, (tf.data.Dataset, FileSource)) and hasattr(x, "shard"):
        raise InputError(
            f"keras_distrib.predict cannot put the rows of a {type(x).__name__} back in order. "
            "HINT: pass arrays, a tf.data.Dataset or a keras_distrib.data.FileSource."
        )
    if is_py_dataset(x) or not isinstance(x, (tuple, list, dict)) and hasattr(x, "__next__"):
        raise InputError(
            f"keras_distrib.predict does not take a {type(x).__name__} (it cannot key its rows to put them "
            "back in order). HINT: pass arrays or a tf.data.Dataset (e.g. tf.data.Dataset.from_generator)."
        )
    if isinstance(x, FileSource):
        if steps is not None:
            raise InputError(
                "steps= is not supported for a FileSource in keras_distrib.predict. HINT: predict "
                "on fewer files, or pass a tf.data.Dataset with .take(n)."
            )
        return KeyedFileSource(x.files, x.reader, x.num_examples, x.batched)
    if isinstance(x, tf.data.Dataset):
        batched = bool(DatasetSource(x).batched)
        if steps is not None:
            x = x.take(steps if batched else steps * batch_size)
        keyed = DatasetSource(_keyed_elements(x, batched))  # batched=None: reads the graph now, eagerly
        keyed.batched = batched  # enumerate() hides the final batch from that detection
        return keyed
    if isinstance(x, list):
        x = tuple(x) if len(x) > 1 else x[0]
    n = ArraySource(x).num_examples or 0
    if steps is not None:
        n = min(n, steps * batch_size)
        x = map_nest(lambda a: a[:n], x)
    keys = np.zeros((n, KEY_COLUMNS), np.int64)
    keys[:, 2] = np.arange(n)
    return ArraySource((keys, x))


