"""A worker's compute: the model's own JAX ``train_step``, XLA-compiled over a part's batches.

The state is Keras' JAX trainer's ``(trainable, non_trainable, optimizer, metrics)`` tuple.
The parameter servers hold the float variables of the first three (`held_indices`): the
weights, the layers' float state (BatchNorm's statistics) and the optimizer's (momentum, Adam's
moments). A worker keeps its metric states (reset for every part, so each part's are summed by
the chief) and its integer state (the optimizer's iteration count, so learning-rate schedules
follow the worker's own steps; dropout seeds) to itself.

A worker pushes each held variable's change over its part. The weights' and the layers'
changes count in full; the optimizer variables' are divided by the number of workers
(`delta_scales`): they are moving averages of the gradients, and N workers' changes from one
starting point added in full overshoot (as in the TensorFlow trainer's ``ps_local_steps``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def flat_variables(model: Any) -> list[Any]:
    """The model's trainable, non-trainable and optimizer variables, in that order."""
    return list(model.trainable_variables) + list(model.non_trainable_variables) + list(model.optimizer.variables)


def held_indices(model: Any) -> list[int]:
    """Positions, in `flat_variables`, of those the ps hold: the floats. The optimizer's
    iteration count stays each worker's own: shared, it made Adam's steps larger (its bias
    correction) and digits lost 4 points against one process with 2 workers (measured)."""
    return [i for i, v in enumerate(flat_variables(model)) if np.issubdtype(np.dtype(v.dtype), np.floating)]


def delta_scales(model: Any, workers: int) -> list[float]:
    """Each held variable's share of a worker's change: 1, or 1/workers for the optimizer's."""
    optimizer_from = len(model.trainable_variables) + len(model.non_trainable_variables)
    return [1.0 if i < optimizer_from else 1.0 / max(1, workers) for i in held_indices(model)]


class LocalSteps:
    """Runs a part's batches through ``model.train_step``: one compiled step, called per batch
    (compiled once per batch shape). Not one ``lax.scan`` over the part: convolutions inside a
    loop body ran 5x slower on CPU (jax-ml/jax#12868; 14 against 71 steps/s, measured)."""

    def __init__(self, model: Any) -> None:
        import jax

        self.model = model
        self.trainable = len(model.trainable_variables)
        self.layer_state = len(model.non_trainable_variables)
        self.held = held_indices(model)
        self.metrics_reset = [np.asarray(v.value) for v in model.metrics_variables]

        def one(state: Any, batch: Any) -> Any:
            return model.train_step(state, batch)[1]

        self._step = jax.jit(one, donate_argnums=0)

    def initial_state(self) -> tuple[list[Any], ...]:
        m = self.model
        # Copies: the compiled run donates its state, and the model's own arrays must stay valid.
        return ([np.array(v.value) for v in m.trainable_variables], [np.array(v.value) for v in m.non_trainable_variables],
                [np.array(v.value) for v in m.optimizer.variables], list(self.metrics_reset))

    def write_back(self, state: Any) -> None:
        """The model's variables set from ``state`` (a worker, after its fit)."""
        m = self.model
        for variables, values in zip((m.trainable_variables, m.non_trainable_variables, m.optimizer.variables),
                                     state[:3]):
            for variable, value in zip(variables, values):
                variable.assign(value)

    def held_values(self, state: Any) -> list[np.ndarray]:
        flat = list(state[0]) + list(state[1]) + list(state[2])
        return [np.asarray(flat[i]) for i in self.held]

    def with_held(self, state: Any, values: Sequence[np.ndarray]) -> tuple[list[Any], ...]:
        """``state`` with the held variables set to ``values`` and the metric states reset."""
        flat = list(state[0]) + list(state[1]) + list(state[2])
        for i, value in zip(self.held, values):
            flat[i] = value
        split = self.trainable + self.layer_state
        return flat[: self.trainable], flat[self.trainable:split], flat[split:], list(self.metrics_reset)

    def with_iterations(self, state: Any, count: int) -> tuple[list[Any], ...]:
        """``state`` with the optimizer's iteration count raised to ``count`` (`resumed_iterations`;
        never lowered: a second ``fit`` goes on counting, as in Keras)."""
        optimizer = self.model.optimizer
        at = next(i for i, v in enumerate(optimizer.variables) if v is optimizer.iterations)
        variables = list(state[2])
        current = np.asarray(variables[at])
        variables[at] = np.asarray(max(int(current), count), current.dtype)
        return state[0], state[1], variables, state[3]

    def metric_states(self, state: Any) -> np.ndarray:
        """The part's metric states, less their reset values, flat (the chief sums them)."""
        parts = [np.asarray(v, np.float64).ravel() - np.asarray(r, np.float64).ravel()
                 for v, r in zip(state[3], self.metrics_reset)]
        return np.concatenate(parts) if parts else np.zeros(0)

    def run(self, state: Any, batches: Sequence[Any]) -> Any:
        """``state`` after every batch of ``batches`` (each ``(x, y[, sample_weight])``)."""
        for batch in batches:
            state = self._step(state, batch)
        return state


def resumed_iterations(epoch: int, first: int, num_batches: int, workers: int) -> int:
    """A worker's optimizer iteration count at the first part it takes (batch ``first`` of
    ``epoch``): its share of the batches before it. A worker that starts late (restarted, or
    every process resumed from a checkpoint) thus counts as one that ran from the start: its
    count drives Adam's bias correction and learning-rate schedules, and from zero again its
    steps were about 0.15x to 0.3x their size for a thousand steps."""
    return (epoch * num_batches + first) // max(1, workers)


def metric_state_size(model: Any) -> int:
    return int(sum(np.asarray(v.value).size for v in model.metrics_variables))


def set_metric_states(model: Any, summed: np.ndarray, reset: Sequence[np.ndarray]) -> None:
    """Put the chief's sums of every part's metric states into the model's metrics."""
    at = 0
    for variable, r in zip(model.metrics_variables, reset):
        r = np.asarray(r)
        variable.assign((summed[at:at + r.size].reshape(r.shape) + r).astype(r.dtype))
        at += r.size

