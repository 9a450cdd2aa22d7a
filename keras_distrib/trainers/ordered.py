"""Order-preserving distributed predict: keyed inputs and the re-assembly of the rows.

Every example gets a key before it is sharded, ``(file, batch, position)`` as three int64
columns, so the output can be put back in the input's order whatever worker predicted it
and whenever its result arrived:

* arrays (dict and list inputs too): ``(0, 0, i)`` for row ``i``;
* a ``tf.data.Dataset``: ``(0, 0, i)`` for element ``i``; batched: ``(0, b, j)`` for row
  ``j`` of batch ``b``;
* a `keras_distrib.data.FileSource`: ``(f, 0, r)`` for record ``r`` of file ``f`` in sorted
  order (the order the files are dealt in); batched readers ``(f, b, j)``.

Keys also make the result robust to a closure run twice (a worker lost and its input
rebuilt in the parameter-server layouts): duplicate keys are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .. import data as kd_data
from ._common import TrainerError

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
class KeyedFileSource(kd_data.BaseSource):
    """A FileSource whose elements are ``(keys, x)``; files dealt as `keras_distrib.data` does."""

    files: Sequence[str]
    reader: Callable[[Any], Any] | None
    num_examples: int | None
    batched: bool

    def shard(self, index: int, num_shards: int) -> Any:
        import tensorflow as tf

        reader = self.reader or tf.data.TFRecordDataset
        mine = kd_data.shard_files(self.files, index, num_shards)
        order = [index + j * num_shards for j in range(len(mine))]  # position in sorted(files)
        files = tf.data.Dataset.from_tensor_slices((np.asarray(order, np.int64), list(mine)))
        return files.interleave(lambda f, path: _keyed_elements(reader(path), self.batched, major=f), cycle_length=1)


def keyed_source(x: Any, *, batch_size: int, steps: int | None) -> Any:
    """The `keras_distrib.data` Source of ``(keys, x)`` elements for ``predict(x)``.

    ``steps`` keeps the first ``steps`` batches of ``batch_size`` rows (of a batched
    dataset: its first ``steps`` batches), as Keras' ``predict(steps=...)`` does.
    """
    import tensorflow as tf

    if not isinstance(x, (tf.data.Dataset, kd_data.FileSource)) and hasattr(x, "shard"):
        raise TrainerError(
            f"keras_distrib.predict cannot put the rows of a {type(x).__name__} back in order. "
            "HINT: pass arrays, a tf.data.Dataset or a keras_distrib.data.FileSource."
        )
    if kd_data.is_py_dataset(x) or not isinstance(x, (tuple, list, dict)) and hasattr(x, "__next__"):
        raise TrainerError(
            f"keras_distrib.predict does not take a {type(x).__name__} (it cannot key its rows to put them "
            "back in order). HINT: pass arrays or a tf.data.Dataset (e.g. tf.data.Dataset.from_generator)."
        )
    if isinstance(x, kd_data.FileSource):
        if steps is not None:
            raise TrainerError(
                "steps= is not supported for a FileSource in keras_distrib.predict. HINT: predict "
                "on fewer files, or pass a tf.data.Dataset with .take(n)."
            )
        return KeyedFileSource(x.files, x.reader, x.num_examples, x.batched)
    if isinstance(x, tf.data.Dataset):
        batched = bool(kd_data.DatasetSource(x).batched)
        if steps is not None:
            x = x.take(steps if batched else steps * batch_size)
        keyed = kd_data.DatasetSource(_keyed_elements(x, batched))  # batched=None: reads the graph now, eagerly
        keyed.batched = batched  # enumerate() hides the final batch from that detection
        return keyed
    if isinstance(x, list):
        x = tuple(x) if len(x) > 1 else x[0]
    n = kd_data.ArraySource(x).num_examples or 0
    if steps is not None:
        n = min(n, steps * batch_size)
        x = kd_data.map_nest(lambda a: a[:n], x)
    keys = np.zeros((n, KEY_COLUMNS), np.int64)
    keys[:, 2] = np.arange(n)
    return kd_data.ArraySource((keys, x))


def output_spec(model: Any, element_spec: Any, call: Any = None) -> Any:
    """The output TensorSpecs of ``call`` (default: ``model(x, training=False)``) for
    ``(keys, x)`` elements (traced, not run)."""
    import tensorflow as tf

    x_spec = element_spec[1]
    call = call or (lambda x: model(x, training=False))
    concrete = tf.function(call).get_concrete_function(x_spec)
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), concrete.structured_outputs)


def empty_rows(spec: Any) -> tuple[Any, Any]:
    """(keys, predictions) with no rows, shaped like ``spec``'s outputs."""
    import tensorflow as tf

    def empty(s: Any) -> Any:
        dims = [0] + [d if d is not None else 0 for d in s.shape.as_list()[1:]]
        return tf.zeros(dims, s.dtype)

    return tf.zeros([0, KEY_COLUMNS], tf.int64), tf.nest.map_structure(empty, spec)


def assemble(parts: Sequence[tuple[Any, Any]], expected: int | None) -> Any:
    """Concatenate ``(keys, predictions)`` parts and put the rows in key order (duplicates dropped)."""
    if not parts:
        raise TrainerError("keras_distrib.predict got no input rows. HINT: pass at least one example.")
    keys = np.concatenate([np.asarray(k).reshape(-1, KEY_COLUMNS) for k, _ in parts])
    order = np.lexsort(keys.T[::-1])
    sorted_keys = keys[order]
    first = np.ones(len(order), bool)
    first[1:] = np.any(sorted_keys[1:] != sorted_keys[:-1], axis=1)
    order = order[first]
    if expected is not None and len(order) != expected:
        raise TrainerError(
            f"keras_distrib.predict gathered {len(order)} rows for {expected} inputs. HINT: this is a "
            "bug in keras_distrib (please report it with the layout and input kind)."
        )
    leaves = zip(*(kd_data.flatten_nest(p) for _, p in parts))  # leaf by leaf, over the parts
    rows = iter([np.concatenate([np.asarray(v) for v in leaf])[order] for leaf in leaves])
    return kd_data.map_nest(lambda _: next(rows), parts[0][1])
