"""Distributed fit/evaluate for Keras 3 models.

``fit`` picks the trainer that serves the active layout: `ParameterServerTrainer`
(asynchronous, ParameterServerStrategy) or `AllReduceTrainer` (synchronous,
MultiWorkerMirroredStrategy); both derive from `keras_distrib.trainers.base.Trainer`,
which holds fit/evaluate and the epoch loop. Importing this package does not import
TensorFlow.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

from ..logs import configure_script

from ._common import TrainerError
from ._private_apis import warn_if_untested

logger = logging.getLogger(__name__)

__all__ = ["fit", "evaluate", "predict", "build", "ParameterServerTrainer", "AllReduceTrainer", "TrainerError", "trainer_for"]

warn_if_untested()

#: model -> its trainer (so the step counter and traced functions survive repeated
#: fit/evaluate calls) without writing attributes on the user's model.
_TRAINERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def __getattr__(name: str) -> Any:
    if name == "ParameterServerTrainer":
        from .ps import ParameterServerTrainer

        return ParameterServerTrainer
    if name == "AllReduceTrainer":
        from .allreduce import AllReduceTrainer

        return AllReduceTrainer
    if name == "build":
        from .placement import build

        return build
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def trainer_for(model: Any, strategy: Any = None, *, steps_per_execution: int | None = None,
                ps_stale_reads: bool | None = None, ps_local_steps: bool | None = None) -> Any:
    """The trainer of ``model`` under ``strategy`` (one per model and strategy).

    ``ps_stale_reads``, ``ps_local_steps``: parameter-server trainer options (see
    `ParameterServerTrainer`); None keeps the trainer's current setting (default False).
    """
    from ._common import resolve_strategy, strategy_kind

    configure_script()
    cached = _TRAINERS.get(model)
    if strategy is None and cached is not None:
        strategy = cached.strategy
    if strategy is None:
        strategy = _model_strategy(model)
    strategy = resolve_strategy(strategy, allow=("ps", "allreduce", "jax-ps"))
    kind = strategy_kind(strategy)
    for option, on in (("ps_stale_reads", ps_stale_reads), ("ps_local_steps", ps_local_steps)):
        if on and kind != "ps":
            raise TrainerError(f"{option}=True needs a parameter-server layout, this job's strategy is "
                               f"{type(strategy).__name__} ({kind}). HINT: drop {option}, or run with "
                               "--layout ps-per-node / worker-per-gpu.")
    if cached is not None and cached.strategy is strategy:
        if steps_per_execution is not None and steps_per_execution != cached.steps_per_execution:
            cached.steps_per_execution = int(steps_per_execution)
            cached.reset_functions()
        if kind == "ps":
            from .ps.modes import requested_mode

            cached.mode = requested_mode(cached.mode, ps_stale_reads, ps_local_steps)
        return cached
    if kind == "jax-ps":
        from .jax_ps import AsyncJaxTrainer

        trainer: Any = AsyncJaxTrainer(model, strategy, steps_per_execution=steps_per_execution)
    elif kind == "ps":
        from .ps import ParameterServerTrainer

        trainer = ParameterServerTrainer(model, strategy, steps_per_execution=steps_per_execution,
                                              stale_reads=ps_stale_reads, local_steps=ps_local_steps)
    else:
        from .allreduce import AllReduceTrainer

        trainer = AllReduceTrainer(model, strategy, steps_per_execution=steps_per_execution)
    _TRAINERS[model] = trainer
    return trainer


def _model_strategy(model: Any) -> Any:
    """The ps/all-reduce strategy ``model`` was built under (Keras records it), else None."""
    from ._common import strategy_kind

    strategy = getattr(model, "distribute_strategy", None)
    return strategy if strategy is not None and strategy_kind(strategy) is not None else None


def _single_process(model: Any, strategy: Any) -> bool:
    """True outside a job: no plan/TF_CONFIG, no trainer yet and no distribution strategy."""
    import os

    from .. import contract

    if contract.in_job(os.environ) or model in _TRAINERS:
        return False
    from ._common import strategy_kind

    if strategy is None:
        import tensorflow as tf

        strategy = _model_strategy(model) or tf.distribute.get_strategy()
    return strategy_kind(strategy) is None and not contract.layout(os.environ)


def _keras_fit(model: Any, *args: Any, seed: Any = None, checkpoint_dir: str | None = None, **kwargs: Any) -> Any:
    """Plain ``model.fit`` (outside a job); ``checkpoint_dir`` becomes BackupAndRestore."""
    import keras

    if args and len(args) == 1 and isinstance(args[0], tuple) and "y" not in kwargs:
        args = args[0]  # keras_distrib.fit(model, (x, y)) -> model.fit(x, y)
    if checkpoint_dir:
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [keras.callbacks.BackupAndRestore(checkpoint_dir)]
    return model.fit(*args, **kwargs)


def fit(model: Any, *args: Any, strategy: Any = None, steps_per_execution: int | None = None,
        ps_stale_reads: bool | None = None, ps_local_steps: bool | None = None, **kwargs: Any) -> Any:
    """Train a compiled Keras 3 model on the active keras_distrib layout, like ``model.fit``.

    Takes ``model.fit``'s arguments (see `keras_distrib.trainers.base.Trainer.fit` and the
    table in docs/training.md), plus ``strategy`` (default: the active one), ``steps_per_execution``
    (steps per scheduled function; default: the model's compiled value if above 1, else 10), ``seed`` (shuffling) and
    ``checkpoint_dir`` (resume from / save to every epoch), ``ps_stale_reads`` or
    ``ps_local_steps`` (opt-in, parameter server only, change the training semantics: one
    variable read per closure; or K local steps per closure, see docs/training.md). ``x`` may be arrays (dict
    inputs too), ``(x, y[, sample_weight])``, a ``tf.data.Dataset``, a ``keras.utils.PyDataset``
    or a `keras_distrib.data` source; it is sharded disjointly over the workers
    (docs/input-kinds.md; a Python generator is refused with a HINT).
    ``batch_size``: examples per optimizer update (parameter server: each worker step;
    all-reduce: the global batch, split over the workers). Returns the History.
    """
    configure_script()
    if _single_process(model, strategy):
        logger.info("not inside a keras_distrib job: training with Keras model.fit in this process")
        return _keras_fit(model, *args, **kwargs)
    trainer = trainer_for(model, strategy, steps_per_execution=steps_per_execution, ps_stale_reads=ps_stale_reads,
                          ps_local_steps=ps_local_steps)
    return trainer.fit(*args, **kwargs)


def evaluate(model: Any, *args: Any, strategy: Any = None, **kwargs: Any) -> Any:
    """Distributed ``model.evaluate``: every example once; returns what Keras returns (the
    loss alone as a scalar, else a list in ``model.metrics_names`` order; the dict with
    ``return_dict=True``). A model's own ``test_step`` runs for every batch."""
    if _single_process(model, strategy):
        if args and len(args) == 1 and isinstance(args[0], tuple) and "y" not in kwargs:
            args = args[0]
        return model.evaluate(*args, **{"verbose": 0, **kwargs})
    return trainer_for(model, strategy).evaluate(*args, **kwargs)


def predict(model: Any, x: Any, *, strategy: Any = None, **kwargs: Any) -> Any:
    """Distributed ``model.predict``: the rows come back in ``x``'s order.

    ``x``: arrays (dict/list inputs too), a ``tf.data.Dataset`` (of ``x`` or ``(x, y[, sw])``,
    batched or not) or a `keras_distrib.data.FileSource` (its files in sorted order).
    Parameter-server layouts: the chief schedules closures over every worker's shard and
    returns all rows. All-reduce: call it on every worker (like fit); each worker predicts
    its shard and every worker returns all rows. ``batch_size`` as in ``fit``; ``steps``
    keeps the first ``steps`` batches, as Keras does. Outside a job: ``model.predict``.
    jax layouts: every process predicts every row (`keras_distrib.jax_distribution.predict`).
    """
    import os

    from .. import contract
    from ..plan import JAX_LAYOUTS

    if contract.layout(os.environ) in JAX_LAYOUTS:
        from ..jax_distribution import predict as jax_predict

        return jax_predict(model, x, **kwargs)
    if _single_process(model, strategy):
        return model.predict(x, **{"verbose": 0, **kwargs})
    return trainer_for(model, strategy).predict(x, **kwargs)


def _signature_from(method_name: str, extra: list[inspect.Parameter]) -> inspect.Signature:
    from .base import Trainer

    params = list(inspect.signature(getattr(Trainer, method_name)).parameters.values())[1:]
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([model] + params + extra)


def _kw(name: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)


# The public signatures are Trainer.fit/evaluate's, written once (for help() and IDEs);
# base imports no TensorFlow, so this stays cheap.
fit.__signature__ = _signature_from("fit", [_kw("strategy"), _kw("steps_per_execution"), _kw("ps_stale_reads"),
                                            _kw("ps_local_steps")])  # type: ignore[attr-defined]
evaluate.__signature__ = _signature_from("evaluate", [_kw("strategy")])  # type: ignore[attr-defined]
predict.__signature__ = _signature_from("predict", [_kw("strategy")])  # type: ignore[attr-defined]
