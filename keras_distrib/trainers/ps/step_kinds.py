"""The step kinds a closure runs: one object per kind, handed to the closure compiler.

As Keras hands its step function to ``_make_function``, `compiler.ChunkCompiler` is
handed one `StepKind`, picked once per compiled function by `step_kind` from the
trainer's `PsMode` and the model:

* `DefaultStep`: the trainer's own step (gradients applied to the ps variables);
* `ModelStep`: the model's own ``train_step`` / ``test_step`` (Keras' contract), its logs
  carried to the chief;
* `StaleReadsStep` (``ps_stale_reads``): the weights read once per closure, every step's
  gradients computed at those values;
* `LocalSteps` (``ps_local_steps``): the closure's steps on a local copy, the changes
  added to the ps once.

A kind opens a closure (`begin`): the carry its loops start from, its ``advance`` (one
step: ``advance(iterator, carry, endless) -> carry``, the carry being ``(totals,
exhausted, extra)``) and its ``end`` (the totals, whether the shard ended, the logs and
the updates the closure's result waits for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _private_apis as private
from .. import packing
from .. import steps as step_contract
from ..metrics import batch_size_of, step_totals, unpack
from .modes import PsMode

Carry = tuple[Any, ...]


@dataclass(frozen=True)
class ClosureSteps:
    """One closure's steps of a kind: where they start, one step, and what they end with."""

    carry: Carry
    advance: Callable[[Any, Carry, bool], Carry]
    #: ``(totals, exhausted, logs, updates)``; logs None: the kind has none.
    end: Callable[[Carry], tuple[Any, Any, Any, list[Any]]]


class StepKind(Protocol):
    def begin(self, iterator: Any, counted: bool, zeros: dict[str, Any]) -> ClosureSteps:
        """Open one closure (in its trace): its first carry, its step and its end."""


def step_kind(compiler: Any) -> StepKind:
    """The kind ``compiler`` runs: the trainer's mode in training, else the model's own
    step where it has one, else the default step."""
    mode = compiler.trainer.mode if compiler.training else PsMode.DEFAULT
    if mode is PsMode.LOCAL_STEPS:
        return LocalSteps(compiler)
    if mode is PsMode.STALE_READS:
        return StaleReadsStep(compiler)
    return DefaultStep(compiler) if compiler.user_step is None else ModelStep(compiler)


def _false() -> Any:
    import tensorflow as tf

    return tf.constant(False)


def next_input(iterator: Any, endless: bool) -> tuple[Any, Any]:
    """(has_value, batch getter); has_value None when the input cannot run out."""
    if endless:
        element = next(iterator)
        return None, lambda: element
    optional = iterator.get_next_as_optional()
    return optional.has_value(), optional.get_value


def guarded(has_value: Any, run: Any, skip: Any) -> Any:
    """``run()`` where the input cannot run out (``has_value`` None), else a cond: a cond per
    step costs (docs/performance-history.md), so an input that cannot run out (steps_per_epoch, no
    empty shard) runs without."""
    import tensorflow as tf

    return run() if has_value is None else tf.cond(has_value, run, skip)


class _OnThePs:
    """The kinds that update the ps variables step by step: ``optimizer.iterations`` starts
    at the closure's true step, and the result waits for its last value."""

    def __init__(self, compiler: Any) -> None:
        self.c = compiler

    def _start_iterations(self) -> None:
        if self.c.training:
            # Schedules and Adam's bias correction see the true step (up to the chunks in
            # flight elsewhere); the chief makes iterations exact at every epoch end.
            self.c.opt.iterations.assign(self.c.step_as_iterations())

    def _updates(self) -> list[Any]:
        import tensorflow as tf

        return [tf.identity(self.c.opt.iterations.value)] if self.c.training else []


class DefaultStep(_OnThePs):
    """The trainer's own train or test step, run on the worker's replica."""

    def begin(self, iterator: Any, counted: bool, zeros: dict[str, Any]) -> ClosureSteps:
        self._start_iterations()
        return ClosureSteps((zeros, _false(), ()), self.advance, lambda c: (c[0], c[1], None, self._updates()))

    def advance(self, iterator: Any, carry: Carry, endless: bool) -> Carry:
        import tensorflow as tf

        totals, exhausted, extra = carry
        has_value, batch = next_input(iterator, endless)

        def run() -> Carry:
            loss, n, state, finite = self.c.strategy.run(self.c.replica_step, args=(batch(), totals["state"]))
            return step_totals(totals, loss, n, state, finite), exhausted, extra

        return guarded(has_value, run, lambda: (totals, tf.constant(True), extra))


class ModelStep(_OnThePs):
    """The model's own ``train_step`` / ``test_step``, run as compiled; its last logs carried."""

    def begin(self, iterator: Any, counted: bool, zeros: dict[str, Any]) -> ClosureSteps:
        import tensorflow as tf

        self._start_iterations()
        # The value carried before the first step: zeros shaped like the step's logs (its
        # trace, reused by every step; nothing runs here).
        element = iterator.element_spec[1] if counted else iterator.element_spec
        spec = tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, s.dtype), element)
        first_logs = step_contract.output_zeros(self.c.user_step, spec)
        return ClosureSteps((zeros, _false(), first_logs), self.advance, lambda c: (c[0], c[1], c[2], self._updates()))

    def advance(self, iterator: Any, carry: Carry, endless: bool) -> Carry:
        import tensorflow as tf

        totals, exhausted, logs = carry
        has_value, batch = next_input(iterator, endless)

        def run() -> Carry:
            data = batch()
            out = self.c.user_step(data)
            n = batch_size_of(unpack(data)[0])
            return step_totals(totals, 0.0, n, totals["state"], step_contract.logs_finite(out)), exhausted, out

        return guarded(has_value, run, lambda: (totals, tf.constant(True), logs))


class StaleReadsStep(_OnThePs):
    """Stale reads: the weights read once, the closure's gradients computed at those values."""

    def begin(self, iterator: Any, counted: bool, zeros: dict[str, Any]) -> ClosureSteps:
        c = self.c
        self._start_iterations()
        values = packing.read_packed(c.variables, c.groups)
        carry = (zeros, _false(), packing.read_packed(c.state_variables, c.state_groups))
        return ClosureSteps(carry, lambda it, carry, endless: self.advance(it, carry, values, endless),
                            lambda c: (c[0], c[1], None, self._updates()))

    def advance(self, iterator: Any, carry: Carry, values: list[Any], endless: bool) -> Carry:
        # Two conds on purpose: the first (compute, on the worker) touches no variable,
        # so the next step's compute does not wait for this step's update on the ps.
        import tensorflow as tf

        trainer, strategy = self.c.trainer, self.c.strategy
        totals, exhausted, held = carry
        has_value, batch = next_input(iterator, endless)

        def run() -> Carry:
            loss, n, state, finite, grads, new_held = strategy.run(
                trainer.stale_train_step, args=(batch(), totals["state"], values, held))
            return step_totals(totals, loss, n, state, finite), exhausted, grads, new_held

        def skip() -> Carry:
            return totals, tf.constant(True), [tf.zeros_like(v) for v in values], held

        totals, exhausted, grads, new_held = guarded(has_value, run, skip)
        guarded(has_value, lambda: strategy.run(trainer.apply_stale, args=(grads, held, new_held)),
                lambda: tf.constant(False))
        return totals, exhausted, new_held


class LocalSteps:
    """Local steps: the closure's steps on a local copy (variables, state, optimizer slots
    and the step), the changes added to the ps once at its end."""

    def __init__(self, compiler: Any) -> None:
        self.c = compiler
        # The optimizer's update as a pure function of the local copy.
        self.view = private.stateless_optimizer(compiler.opt, compiler.variables)

    def begin(self, iterator: Any, counted: bool, zeros: dict[str, Any]) -> ClosureSteps:
        c = self.c
        start = (packing.read_packed(c.variables, c.groups), packing.read_packed(c.state_variables, c.state_groups),
                 packing.read_packed(c.opt_floats, c.opt_groups), c.step_as_iterations())

        def end(carry: Carry) -> tuple[Any, Any, Any, list[Any]]:
            totals, exhausted, last = carry
            updates = (packing.add_packed(c.variables, c.groups, start[0], last[0])
                       + packing.add_changes(c.state_variables, start[1], last[1])
                       + packing.add_packed(c.opt_floats, c.opt_groups, start[2], last[2],
                                            1.0 / c.trainer.num_workers))
            return totals, exhausted, None, updates

        return ClosureSteps((zeros, _false(), start), self.advance, end)

    def advance(self, iterator: Any, carry: Carry, endless: bool) -> Carry:
        # The cond's branches touch only the worker: no ps round trip per step.
        import tensorflow as tf

        totals, exhausted, local = carry
        has_value, batch = next_input(iterator, endless)

        def run() -> Carry:
            loss, n, state, finite, new_local = self.c.strategy.run(
                self.c.trainer.local_train_step, args=(batch(), totals["state"], local, self.view))
            return step_totals(totals, loss, n, state, finite), exhausted, new_local

        return guarded(has_value, run, lambda: (totals, tf.constant(True), local))
