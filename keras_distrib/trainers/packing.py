"""Packed variable traffic between a worker and its parameter servers (traced helpers).

Why: in asynchronous PS training every step reads every trainable variable from its ps
and sends every gradient back, and TensorFlow moves each tensor between processes with
its own rendezvous RPC. Packing one ps's variables of one dtype into a single flat tensor
(concatenated on the ps, split on the worker; gradients the other way round) turns
2 x (variables) transfers per step into 2 x (ps x dtypes), plus two per large variable
(`MAX_PACKED_ELEMENTS`). The forward pass then runs
on the unpacked values through a `keras.StatelessScope`, and non-trainable state the
model updated (BatchNorm statistics, dropout seeds) is added back afterwards (`add_back`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ._common import _device

#: Variables larger than this many elements travel on their own. Measured (bench cluster,
#: wide_mlp of bench/models/extra_models.py with three 512x512 kernels, ratio to the
#: unrolled hand loop, 3 rounds): all packed 0.92, kernels alone 1.00.
MAX_PACKED_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class PackGroup:
    """Trainable variables sharing a device and dtype, packed into one transfer."""

    device: str
    indices: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]


def pack_groups(variables: Sequence[Any], max_elements: int = MAX_PACKED_ELEMENTS) -> list[PackGroup]:
    """Group ``variables`` by (device, dtype), keeping their order within a group.

    Variables over ``max_elements`` get a group of their own: copying them into a packed
    buffer costs more than the transfer it saves.
    """
    shapes = [tuple(int(d) for d in v.shape) for v in variables]
    by_key: dict[tuple[str, str] | int, list[int]] = {}
    for i, (v, shape) in enumerate(zip(variables, shapes)):
        big = math.prod(shape) > max_elements
        by_key.setdefault(i if big else (_device(v), str(v.dtype)), []).append(i)
    return [
        PackGroup(_device(variables[ix[0]]), tuple(ix), tuple(shapes[i] for i in ix), tuple(math.prod(shapes[i]) for i in ix))
        for ix in by_key.values()
    ]


def read_packed(variables: Sequence[Any], groups: Sequence[PackGroup]) -> list[Any]:
    """Current values of ``variables`` as worker tensors, one transfer per group."""
    import tensorflow as tf

    values: list[Any] = [None] * len(variables)
    for g in groups:
        with tf.device(g.device):
            flat = tf.concat([tf.reshape(variables[i].value, [-1]) for i in g.indices], axis=0)
        for i, part, shape in zip(g.indices, tf.split(flat, list(g.sizes)), g.shapes):
            values[i] = tf.reshape(part, shape)
    return values


def send_packed(grads: Sequence[Any], groups: Sequence[PackGroup]) -> list[Any]:
    """``grads`` moved to their variables' devices, one transfer per group.

    Missing (None) and sparse (IndexedSlices) gradients are left as they are: packing
    would turn a sparse update into a dense one.
    """
    import tensorflow as tf

    out = list(grads)
    for g in groups:
        dense = [(i, shape, size) for i, shape, size in zip(g.indices, g.shapes, g.sizes)
                 if grads[i] is not None and not isinstance(grads[i], tf.IndexedSlices)]
        if not dense:
            continue
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i, _, _ in dense], axis=0)
        with tf.device(g.device):
            parts = tf.split(flat, [size for _, _, size in dense])
            for (i, shape, _), part in zip(dense, parts):
                out[i] = tf.reshape(part, shape)
    return out


def add_back(scope: Any, variables: Sequence[Any], read: Sequence[Any]) -> None:
    """Add to each variable what the step changed: the `keras.StatelessScope`'s value minus ``read``.

    Why: in asynchronous training several workers update the same non-trainable state
    (BatchNorm's moving mean and variance) at once. Assigning the new value is a
    read-modify-write on the ps: a worker overwrites the updates the others made since its
    read, so with k workers about (k-1)/k of the updates are lost and the statistics lag
    behind the weights (measured: -1.4 points of test accuracy with 2 workers, -1.9 with 3
    on the CNN of bench/accuracy_parity.py). The ps applies each ``assign_add`` atomically,
    so no update is lost.
    """
    add_changes(variables, read, [scope.get_current_value(v) for v in variables])


def add_changes(variables: Sequence[Any], before: Sequence[Any], after: Sequence[Any | None]) -> list[Any]:
    """``v += after - before`` for float variables (atomic on their device); others assigned.

    Returns the update ops."""
    import tensorflow as tf

    ops = []
    for v, old, new in zip(variables, before, after):
        if new is None or new is old:
            continue
        if "float" in str(v.dtype):
            # The tf.Variable's own assign_add (one AssignAddVariableOp on the ps): Keras'
            # Variable.assign_add is assign(self + value), a read-modify-write again.
            ops.append(v.value.assign_add(tf.cast(new - old, v.value.dtype)))
        else:  # seed counters: any fresh value will do
            ops.append(v.assign(new))
    return ops


def add_packed(variables: Sequence[Any], groups: Sequence[PackGroup], before: Sequence[Any],
               after: Sequence[Any], scale: float = 1.0) -> list[Any]:
    """``v += scale * (after - before)`` for every variable, one transfer per group (atomic on the ps).

    The changes are packed on the worker, split on each group's device and added there
    with the tf.Variable's own ``assign_add``, so concurrent workers lose no update (see
    `add_back`). Returns the update ops.
    """
    import tensorflow as tf

    ops = []
    for g in groups:
        flat = tf.concat([tf.reshape(after[i] - before[i], [-1]) for i in g.indices], axis=0)
        if scale != 1.0:
            flat = flat * tf.cast(scale, flat.dtype)
        with tf.device(g.device):
            for i, part, shape in zip(g.indices, tf.split(flat, list(g.sizes)), g.shapes):
                v = variables[i]
                ops.append(v.value.assign_add(tf.cast(tf.reshape(part, shape), v.value.dtype)))
    return ops
