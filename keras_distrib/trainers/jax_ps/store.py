"""The model's variables on the parameter servers, reached through TensorFlow's gRPC runtime.

Every SCRIPT process (the chief and the JAX workers) is its own TensorFlow eager client of
the ps tasks (`keras_distrib.strategies.AsyncJaxStrategy`). A variable lives on one ps task as a resource with a shared name
(``keras_distrib/m<model>/v<i>``): every client that asks for that name on that task gets
the same variable, which is how the chief creates them and the workers find them. Updates are
``AssignAddVariableOp`` (atomic per variable on the ps); one `push_pull` is one tf.function
call, so one round trip per ps task carries a worker's deltas and brings back the values.
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
    """One variable on the parameter servers."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ps: int


def slots_for(model_number: int, values: Sequence[np.ndarray], num_ps: int) -> list[Slot]:
    """Each of ``values``' variable placed on a ps task, balanced by size (pure)."""
    where = plan_placement([int(v.size) for v in values], num_ps)
    return [Slot(f"keras_distrib/m{model_number}/v{i}", tuple(v.shape), str(v.dtype), ps)
            for i, (v, ps) in enumerate(zip(values, where))]


class ParameterStore:
    """The variables of one model on the ps tasks: created by the chief, found by the workers."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        import tensorflow as tf

        self.slots = list(slots)
        self.handles = []
        for slot in self.slots:
            with tf.device(f"/job:{PS}/task:{slot.ps}"):
                self.handles.append(tf.raw_ops.VarHandleOp(dtype=tf.as_dtype(slot.dtype), shape=slot.shape,
                                                           shared_name=slot.name, container=""))
        self._push_pull = tf.function(self._push_pull_graph)
        self._assign = tf.function(self._assign_graph)

    def _read_all(self) -> list[Any]:
        import tensorflow as tf

        out = []
        for slot, handle in zip(self.slots, self.handles):
            with tf.device(f"/job:{PS}/task:{slot.ps}"):
                out.append(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.as_dtype(slot.dtype)))
        return out

    def _push_pull_graph(self, deltas: list[Any]) -> list[Any]:
        import tensorflow as tf

        adds = []
        for slot, handle, delta in zip(self.slots, self.handles, deltas):
            with tf.device(f"/job:{PS}/task:{slot.ps}"):
                adds.append(tf.raw_ops.AssignAddVariableOp(resource=handle, value=delta))
        with tf.control_dependencies(adds):  # this worker's deltas are in what it reads back
            return self._read_all()

    def _assign_graph(self, values: list[Any]) -> list[Any]:
        import tensorflow as tf

        sets = []
        for slot, handle, value in zip(self.slots, self.handles, values):
            with tf.device(f"/job:{PS}/task:{slot.ps}"):
                sets.append(tf.raw_ops.AssignVariableOp(resource=handle, value=value))
        with tf.control_dependencies(sets):
            return self._read_all()

    def assign(self, values: Sequence[np.ndarray]) -> None:
        """Set every variable (the chief: at build, and from a checkpoint)."""
        self._assign([np.asarray(v, dtype=s.dtype) for v, s in zip(values, self.slots)])

    def push_pull(self, deltas: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Add ``deltas`` to the variables and return their values after that (one round trip)."""
        values = self._push_pull([np.asarray(d, dtype=s.dtype) for d, s in zip(deltas, self.slots)])
        return [v.numpy() for v in values]

    def pull(self) -> list[np.ndarray]:
        return self.push_pull([np.zeros(s.shape, s.dtype) for s in self.slots])

    def initialized(self) -> bool:
        import tensorflow as tf

        for slot, handle in zip(self.slots, self.handles):
            with tf.device(f"/job:{PS}/task:{slot.ps}"):
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
