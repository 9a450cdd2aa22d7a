"""Order-preserving distributed predict: the re-assembly of the rows.

Every example gets a key before it is sharded (`keras_distrib.data.keyed_source`),
``(file, batch, position)`` as three int64 columns, so the output can be put back in the
input's order whatever worker predicted it and whenever its result arrived:

* arrays (dict and list inputs too): ``(0, 0, i)`` for row ``i``;
* a ``tf.data.Dataset``: ``(0, 0, i)`` for element ``i``; batched: ``(0, b, j)`` for row
  ``j`` of batch ``b``;
* a `keras_distrib.data.FileSource`: ``(f, 0, r)`` for record ``r`` of file ``f`` in sorted
  order (the order the files are dealt in); batched readers ``(f, b, j)``.

Keys also make the result robust to a closure run twice (a worker lost and its input
rebuilt in the parameter-server layouts): duplicate keys are dropped.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import data as kd_data
from ..data.keyed import KEY_COLUMNS
from ._common import TrainerError


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
