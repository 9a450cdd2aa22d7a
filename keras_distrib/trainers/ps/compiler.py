"""The closure compiler: the tf.function a scheduled closure runs (up to K steps of one
worker's shard, in the mode the trainer is in), with the unrolling rules.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import _private_apis as private
from .. import packing
from .. import steps as step_contract
from ..metrics import pack_totals, zeros_totals
from .readers import Batches, Gathered, skip_to
from .step_kinds import step_kind

logger = logging.getLogger(__name__)


#: Chunks up to this many steps are unrolled in the trace; longer ones use a graph loop.
MAX_UNROLLED_STEPS = 32

#: ...and only while steps x trainable variables stays below this: trace time and graph
#: size grow with both, and for big models the loop's per-step cost matters little.
MAX_UNROLLED_VARIABLE_STEPS = 4000

#: ...and only while the chunk's other steps add at most this many graph operations (the
#: first step's count, times the steps left): a step of many operations is a big step,
#: which the loop's per-step cost hardly slows, while each unrolled copy costs trace and
#: compile time (about 0.3-1 ms per operation on CPU: docs/performance-history.md). Counted, not
#: timed, so the graph that runs is the same on every machine.
UNROLL_OPERATIONS_BUDGET = 10_000


def make_chunk_fn(trainer: Any, training: bool) -> Any:
    """The tf.function one closure of ``trainer`` runs: up to K steps of a worker's shard
    (``training``: train steps, else test steps), in the trainer's mode."""
    return ChunkCompiler(trainer, training).compiled()


class ChunkCompiler:
    """The steps of one closure of ``trainer`` (``training``: train steps, else test steps).

    It is handed one step kind (step_kinds.py, picked once from the trainer's mode and the
    model), which advances a carry ``(totals, exhausted, extra)`` by one batch. The loops
    (`steps`, `counted_steps`, `sure_steps`, `loop`) run it K times over the closure's
    batches, unrolled or in a graph loop; `run_chunk` is the function the chief schedules.
    """

    def __init__(self, trainer: Any, training: bool) -> None:
        import keras

        self.trainer, self.training = trainer, training
        model = trainer.model
        self.model, self.opt, self.step, self.metrics = model, trainer.optimizer, trainer.global_step, trainer.metrics
        self.strategy = trainer.strategy
        self.variables, self.state_variables = model.trainable_variables, model.non_trainable_variables
        self.groups, self.state_groups = trainer._groups
        method = "train_step" if training else "test_step"
        # The model's own step (Keras' contract): run as compiled, its logs carried.
        self.user_step = (step_contract.compiled_step(getattr(model, method), self.strategy)
                          if method in trainer.custom_steps else None)
        self.replica_step = trainer.train_step if training else trainer.test_step
        if self.user_step is not None:
            # The model's own steps update its metrics and optimizers in place on the ps, from
            # every worker at once: Keras' read-modify-write increments would lose updates.
            # Counters of its own too (add_weight + assign_add: 52 of 60 steps were counted).
            for variable in [v for m in model.metrics for v in m.variables] + [
                    o.iterations for o in step_contract.step_optimizers(model)] + [
                    v for v in model.non_trainable_variables if isinstance(v, keras.Variable)]:
                private.make_increments_atomic(variable)
        self.opt_floats = trainer._opt_floats
        self.opt_groups = packing.pack_groups(self.opt_floats)
        self.kind = step_kind(self)  # chosen once: the function's traces all run this kind

    def compiled(self) -> Any:
        return step_contract.compiled(self.run_chunk)

    def finish(self, shard: Any, totals: dict[str, Any], exhausted: Any, logs: Any, updates: list[Any],
               started: Any) -> Any:
        """The closure's result: ``[shard, exhausted, seconds it ran on its worker, totals...]``."""
        import tensorflow as tf

        with tf.control_dependencies([*tf.nest.flatten(totals), exhausted, *updates]):
            seconds = tf.timestamp() - started  # the worker's own clock: no skew, no chief in it
        head = tf.stack([tf.cast(shard, tf.float64), tf.cast(exhausted, tf.float64), seconds])
        result = tf.concat([head, pack_totals(totals)], axis=0)
        if self.training:
            # Counted last (atomic on the ps), after the last update and the result, so a
            # closure lost with its worker before that point is not counted; its re-run is.
            with tf.control_dependencies([result, *updates]):
                with tf.control_dependencies([self.step.assign_add(totals["steps"])]):
                    result = tf.identity(result)
        return result if logs is None else {"vector": result, "logs": logs}

    # ------------------------------------------------------------ loops over a closure's batches

    def counted_steps(self, iterator: Any, carry: tuple[Any, ...], num_steps: int, advance: Any, unroll: bool) -> Any:
        """Up to ``num_steps`` steps over a counted shard (`with_countdown`): one look at
        how many batches are left decides, for the whole closure, between the K steps
        and the shard's last ``left`` steps (a graph loop, once per shard and epoch); no
        step needs its own guard. One cond per closure still costs (docs/performance-history.md),
        so the chief sends the closures it knows the shard can fill to `sure_steps` instead."""
        import tensorflow as tf

        optional = iterator.get_next_as_optional()

        def some() -> tuple[Any, ...]:
            left, first = optional.get_value()

            def full() -> tuple[Any, ...]:
                return self.sure_steps(iterator, carry, num_steps, advance, unroll, (left, first))

            def rest() -> tuple[Any, ...]:
                return finished(then(iterator, advance(Batches(iterator, first), carry), left - 1, advance), True)

            return tf.cond(left >= tf.cast(num_steps, left.dtype), full, rest)

        return tf.cond(optional.has_value(), some, lambda: finished(carry, True))

    def sure_steps(self, iterator: Any, carry: tuple[Any, ...], num_steps: int, advance: Any, unroll: bool,
                   element: Any = None) -> Any:
        """``num_steps`` steps over a counted shard that holds at least that many batches
        (the chief made sure, or ``element``, the first, says so): no look, no guard."""
        import tensorflow as tf

        left, first = next(iterator) if element is None else element
        c, unroll_rest = first_step_then_decide(lambda: advance(Batches(iterator, first), carry), num_steps, unroll)
        if unroll_rest:  # unrolled: docs/performance-history.md
            for _ in range(num_steps - 1):
                c = advance(Batches(iterator), c)
        else:
            c = then(iterator, c, tf.cast(num_steps - 1, left.dtype), advance)
        return finished(c, tf.equal(left, tf.cast(num_steps, left.dtype)))

    def steps(self, iterator: Any, carry: tuple[Any, ...], num_steps: int, endless: bool, counted: bool,
              advance: Any, unroll: bool = True) -> tuple[Any, ...]:
        """``num_steps`` calls of ``advance(batches, carry, endless)``, one step of the mode;
        ``counted`` and ``endless``: a counted shard the chief knows can fill them."""
        import tensorflow as tf

        if counted and endless:
            return self.sure_steps(iterator, carry, num_steps, lambda it, c: advance(it, c, True), unroll)
        if counted:
            return self.counted_steps(iterator, carry, num_steps, lambda it, c: advance(it, c, True), unroll)
        if isinstance(num_steps, tf.Tensor):  # a part's remainder (`steps_arg`): all in a graph loop
            return loop(iterator, carry, num_steps, 0, lambda it, c: advance(it, c, endless))
        carry, unroll_rest = first_step_then_decide(lambda: advance(iterator, carry, endless), num_steps, unroll)
        if unroll_rest:  # unrolled: docs/performance-history.md
            for _ in range(num_steps - 1):
                carry = advance(iterator, carry, endless)
            return carry
        return loop(iterator, carry, num_steps, 1, lambda it, c: advance(it, c, endless))

    # ------------------------------------------------------------ the scheduled function

    def run_chunk(self, iterator: Any, shard_ids: Any, num_steps: int, endless: bool = False,
                  counted: bool = False, batch_size: int = 0, rows: Any = None, per_run: int = 1,
                  stacked: bool = False, offset: int = 0) -> Any:
        """One closure. ``num_steps`` is a Python int (K): a constant in the graph, so the K
        steps can be unrolled; a part's remainder is a tensor (`steps_arg`): one graph loop
        traced once for every remainder size.

        ``endless``: every shard repeats and is not empty, so no step needs a guard.
        ``counted``: each element carries how many are left in its shard (`with_countdown`);
        with ``endless``, the chief knows the shard holds ``num_steps`` more (`shards_can_fill`).
        ``rows``: the part of the epoch the chief handed out (`DynamicInput`): the rows of its
        ``num_steps`` batches of ``batch_size``, gathered from the whole arrays. ``rows``, a
        scalar: the number of the first batch of this closure's part of a numbered stream of
        runs of ``per_run`` batches (``stacked``: a batched dataset's), ``offset`` its place in
        its run (`DynamicDatasetInput`).
        """
        import tensorflow as tf

        started = tf.timestamp()  # no inputs: it runs as the closure starts on the worker
        shard = next(shard_ids)
        if rows is not None and rows.shape.rank == 0:  # iterator: (streams, sources)
            iterator, endless, counted = skip_to(*iterator, rows, per_run, stacked, offset), True, False
        elif rows is not None:
            iterator, endless, counted = Gathered(next(iterator), rows, batch_size), True, False
        steps = self.kind.begin(iterator, counted, zeros_totals(self.metrics))
        unroll = isinstance(num_steps, int) and (
            num_steps <= MAX_UNROLLED_STEPS and num_steps * len(self.variables) <= MAX_UNROLLED_VARIABLE_STEPS)
        carry = self.steps(iterator, steps.carry, num_steps, endless, counted, steps.advance, unroll)
        totals, exhausted, logs, updates = steps.end(carry)
        return self.finish(shard, totals, exhausted, logs, updates, started)

    def step_as_iterations(self) -> Any:
        import tensorflow as tf

        return tf.cast(self.step.read_value(), self.opt.iterations.dtype)


def first_step_then_decide(first_step: Any, num_steps: int, unroll: bool) -> tuple[Any, bool]:
    """(carry after the first step, whether to unroll the other ``num_steps - 1``):
    unrolled only while they add at most `UNROLL_OPERATIONS_BUDGET` graph operations, at
    the first step's own count."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()  # the tf.function's graph being traced
    before = len(graph.get_operations())
    carry = first_step()
    operations = len(graph.get_operations()) - before
    # One step has no rest: nothing to unroll, and no loop (it would trace the step again).
    unroll_rest = isinstance(num_steps, int) and (
        num_steps <= 1 or (unroll and operations * (num_steps - 1) <= UNROLL_OPERATIONS_BUDGET))
    logger.debug("one step traced to %d operations: the other %d of the chunk %s", operations, num_steps - 1,
                 "unrolled" if unroll_rest else "in a graph loop")
    return carry, unroll_rest


def finished(c: tuple[Any, ...], flag: Any) -> tuple[Any, ...]:
    import tensorflow as tf

    return (c[0], tf.convert_to_tensor(flag), *c[2:])


def then(iterator: Any, c: tuple[Any, ...], more: Any, advance: Any) -> tuple[Any, ...]:
    """``more`` steps of a counted shard in a graph loop (written out: the branches are
    traced as the Python they are, without AutoGraph)."""
    import tensorflow as tf

    def body(i: Any, c: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        return i + 1, advance(Batches(iterator), c)

    return tf.while_loop(lambda i, _: i < more, body, (tf.zeros_like(more), c))[1]


def loop(iterator: Any, carry: tuple[Any, ...], num_steps: Any, done: int, advance: Any) -> tuple[Any, ...]:
    """Steps ``done`` .. ``num_steps`` in a graph loop, until they ran or the shard ended (``carry[1]``)."""
    import tensorflow as tf

    if hasattr(iterator, "loop"):  # batches found by their place in the part: its own loop
        return iterator.loop(advance, carry, num_steps - done)

    def body(i: Any, c: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        return i + 1, advance(iterator, c)

    return tf.while_loop(lambda i, c: tf.logical_and(i < num_steps, tf.logical_not(c[1])), body,
                         (tf.constant(done), carry))[1]
