"""Distributed fit/evaluate for Keras 3 models.

``fit`` picks the trainer that serves the active layout: `ParameterServerTrainer`
(asynchronous, ParameterServerStrategy) or `AllReduceTrainer` (synchronous,
MultiWorkerMirroredStrategy). Importing this package does not import TensorFlow.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._common import TrainerError

__all__ = ["fit", "evaluate", "build", "ParameterServerTrainer", "AllReduceTrainer", "TrainerError", "trainer_for"]


def __getattr__(name: str) -> Any:
    if name == "ParameterServerTrainer":
        from .ps_async import ParameterServerTrainer

        return ParameterServerTrainer
    if name == "AllReduceTrainer":
        from .allreduce import AllReduceTrainer

        return AllReduceTrainer
    if name == "build":
        from .placement import build

        return build
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def trainer_for(model: Any, strategy: Any = None, *, steps_per_execution: int | None = None) -> Any:
    """The trainer for ``model`` under ``strategy`` (cached on the model, so the step
    counter and traced functions survive repeated fit/evaluate calls)."""
    from ._common import resolve_strategy, strategy_kind

    strategy = resolve_strategy(strategy)
    cached = getattr(model, "_keras_distrib_trainer", None)
    if cached is not None and cached.strategy is strategy:
        if steps_per_execution is not None and steps_per_execution != cached.steps_per_execution:
            cached.steps_per_execution = int(steps_per_execution)
            cached.reset_functions()
        return cached
    kwargs = {} if steps_per_execution is None else {"steps_per_execution": steps_per_execution}
    if strategy_kind(strategy) == "ps":
        from .ps_async import ParameterServerTrainer as cls
    else:
        from .allreduce import AllReduceTrainer as cls
    trainer = cls(model, strategy, **kwargs)
    model._keras_distrib_trainer = trainer
    return trainer


def fit(
    model: Any,
    data: Any,
    *,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    batch_size: int | None = None,
    callbacks: Sequence[Any] | None = None,
    validation_data: Any = None,
    validation_steps: int | None = None,
    steps_per_execution: int | None = None,
    verbose: int = 1,
    strategy: Any = None,
    **kwargs: Any,
) -> Any:
    """Train a compiled Keras 3 model on the active keras_distrib layout.

    ``data``/``validation_data``: ``(x, y[, sample_weight])`` arrays, a batched
    ``tf.data.Dataset`` or a `keras_distrib.data` Source; it is sharded disjointly over
    the workers. ``batch_size``: examples per optimizer update (parameter server: each
    worker step; all-reduce: the global batch, split over the workers).
    ``steps_per_execution``: steps run inside one tf.function call (default 10).
    Other keyword arguments: ``shuffle``, ``seed``, ``initial_epoch``,
    ``validation_batch_size``, ``checkpoint_dir`` (resume from / save to every epoch).
    Returns ``keras.callbacks.History``.
    """
    trainer = trainer_for(model, strategy, steps_per_execution=steps_per_execution)
    return trainer.fit(
        data, epochs=epochs, steps_per_epoch=steps_per_epoch, batch_size=batch_size,
        callbacks=callbacks, validation_data=validation_data, validation_steps=validation_steps,
        verbose=verbose, **kwargs,
    )


def evaluate(model: Any, data: Any, *, steps: int | None = None, batch_size: int | None = None,
             strategy: Any = None) -> dict[str, float]:
    """Distributed evaluation of every example of ``data`` once; returns ``{"loss": ..., metric: ...}``."""
    return trainer_for(model, strategy).evaluate(data, steps=steps, batch_size=batch_size)
