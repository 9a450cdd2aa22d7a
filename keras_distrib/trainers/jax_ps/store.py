"""The model's variables on the parameter servers, reached through TensorFlow's gRPC runtime.

Every SCRIPT process (the chief and the JAX workers) is its own TensorFlow eager client of
the ps tasks (`keras_distrib.strategies.AsyncJaxStrategy`). Each variable is placed on one ps
task, balanced by size; the variables of one dtype on one task are packed, in order, into one
flat buffer there: a resource with a shared name (``keras_distrib/m<model>/ps<task>/<dtype>``),
which every client that asks for that name on that task gets, so the chief creates them and the
workers find them. Updates are ``AssignAddVariableOp`` on a whole buffer (atomic on the ps); one
`push_pull` is one tf.function call, so one round trip per ps task carries a worker's deltas and
brings back the values. One buffer per task, not one resource per variable: each resource
costs the push-and-read its own transfer (the figures: docs/performance.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...plan import CHIEF, PS
from ..placement import plan_placement

logger = logging.getLogger(__name__)

#: Seconds between looks for variables the chief has not initialized yet.
INIT_POLL = 0.2


class StoreError(RuntimeError):
    """The parameter servers do not hold what this process expects; the message has a HINT."""


@dataclass(frozen=True)
class Slot:
    """Where one variable lives: elements ``offset .. offset + size`` of buffer ``buffer``."""

    shape: tuple[int, ...]
    dtype: np.dtype
    buffer: int
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Buffer:
    """One flat variable on a ps task: the variables of one dtype placed there, packed."""

    name: str
    ps: int
    dtype: np.dtype
    size: int


def slots_for(model_number: int, values: Sequence[np.ndarray], num_ps: int) -> tuple[list[Slot], list[Buffer]]:
    """Each of ``values``' variable placed on a ps task, balanced by size, and packed into that
    task's buffer of its dtype (pure; the same on every process that has the same model)."""
    where = plan_placement([int(v.size) for v in values], num_ps)
    keys: dict[tuple[int, np.dtype], int] = {}
    sizes: list[int] = []
    slots = []
    for value, ps in zip(values, where):
        dtype = np.dtype(value.dtype)
        buffer = keys.setdefault((ps, dtype), len(keys))
        if buffer == len(sizes):
            sizes.append(0)
        slots.append(Slot(tuple(value.shape), dtype, buffer, sizes[buffer]))
        sizes[buffer] += int(value.size)
    buffers = [Buffer(f"keras_distrib/m{model_number}/ps{ps}/{dtype}", ps, dtype, sizes[i])
               for (ps, dtype), i in sorted(keys.items(), key=lambda kv: kv[1])]
    return slots, buffers


def pack(slots: Sequence[Slot], buffers: Sequence[Buffer], values: Sequence[Any]) -> list[np.ndarray]:
    """``values`` (one per slot) as the flat contents of each buffer (pure)."""
    out = [np.empty(b.size, dtype=b.dtype) for b in buffers]
    for slot, value in zip(slots, values):
        out[slot.buffer][slot.offset:slot.offset + slot.size] = np.asarray(value, dtype=slot.dtype).ravel()
    return out


def unpack(slots: Sequence[Slot], flats: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The value of each slot, from the buffers' flat contents (pure; views of ``flats``)."""
    return [flats[s.buffer][s.offset:s.offset + s.size].reshape(s.shape) for s in slots]


class ParameterStore:
    """The variables of one model on the ps tasks: created by the chief, found by the workers."""

    def __init__(self, placed: tuple[Sequence[Slot], Sequence[Buffer]]) -> None:
        import tensorflow as tf

        self.slots, self.buffers = list(placed[0]), list(placed[1])
        self.handles = []
        for buffer in self.buffers:
            with tf.device(f"/job:{PS}/task:{buffer.ps}"):
                self.handles.append(tf.raw_ops.VarHandleOp(dtype=tf.as_dtype(buffer.dtype), shape=[buffer.size],
                                                           shared_name=buffer.name, container=""))
        self._push_pull = tf.function(self._push_pull_graph)
        self._assign = tf.function(self._assign_graph)

    def _read_all(self) -> list[Any]:
        import tensorflow as tf

        out = []
        for buffer, handle in zip(self.buffers, self.handles):
            with tf.device(f"/job:{PS}/task:{buffer.ps}"):
                out.append(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.as_dtype(buffer.dtype)))
        return out

    def _push_pull_graph(self, deltas: list[Any]) -> list[Any]:
        import tensorflow as tf

        adds = []
        for buffer, handle, delta in zip(self.buffers, self.handles, deltas):
            with tf.device(f"/job:{PS}/task:{buffer.ps}"):
                adds.append(tf.raw_ops.AssignAddVariableOp(resource=handle, value=delta))
        with tf.control_dependencies(adds):  # this worker's deltas are in what it reads back
            return self._read_all()

    def _assign_graph(self, values: list[Any]) -> list[Any]:
        import tensorflow as tf

        sets = []
        for buffer, handle, value in zip(self.buffers, self.handles, values):
            with tf.device(f"/job:{PS}/task:{buffer.ps}"):
                sets.append(tf.raw_ops.AssignVariableOp(resource=handle, value=value))
        with tf.control_dependencies(sets):
            return self._read_all()

    def assign(self, values: Sequence[np.ndarray]) -> None:
        """Set every variable (the chief: at build, and from a checkpoint)."""
        self._assign(pack(self.slots, self.buffers, values))

    def push_pull(self, deltas: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Add ``deltas`` to the variables and return their values after that (one round trip)."""
        values = self._push_pull(pack(self.slots, self.buffers, deltas))
        return unpack(self.slots, [v.numpy() for v in values])

    def pull(self) -> list[np.ndarray]:
        return self.push_pull([np.zeros(s.shape, s.dtype) for s in self.slots])

    def initialized(self) -> bool:
        import tensorflow as tf

        for buffer, handle in zip(self.buffers, self.handles):
            with tf.device(f"/job:{PS}/task:{buffer.ps}"):
                if not bool(tf.raw_ops.VarIsInitializedOp(resource=handle)):
                    return False
        return True

    def wait_initialized(self, timeout: float, who: str) -> None:
        """Block until the chief has set every variable, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.initialized():
            if time.monotonic() > deadline:
                raise StoreError(
                    f"{who}: the chief did not put the model's {len(self.slots)} variables on the parameter "
                    f"servers within {timeout:.0f} s. HINT: build the model with keras_distrib.trainers.build "
                    f"on every process in the same order (the chief's {CHIEF}:0 log says whether it got there), "
                    "or raise --startup-timeout.")
            time.sleep(INIT_POLL)
