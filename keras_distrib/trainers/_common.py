"""Strategy resolution, model checks, errors, and input helpers the trainers share."""

from __future__ import annotations

import os
from typing import Any, Sequence

from .. import contract
from . import _private_apis as private

RUN_HINT = (
    "Run the script under `python -m keras_distrib.local --nodes 2 SCRIPT` (one machine) "
    "or `srun` via the keras-distrib launcher, and build the model inside "
    "`with keras_distrib.strategy().scope():`."
)


class TrainerError(RuntimeError):
    """The trainer cannot run in this process/layout; the message ends with a HINT."""


def _kind(strategy: Any) -> str | None:
    import tensorflow as tf

    own = getattr(strategy, "keras_distrib_kind", None)  # keras_distrib's own (jax_ps.AsyncJaxStrategy)
    if own is not None:
        return str(own)
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return "ps"
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "allreduce"
    return None


def strategy_kind(strategy: Any) -> str | None:
    """"ps", "allreduce", "jax-ps" or None for a strategy object."""
    return _kind(strategy)


def resolve_strategy(strategy: Any = None, allow: Sequence[str] = ("ps", "allreduce")) -> Any:
    """The explicit ``strategy`` or the one whose scope is active; raise TrainerError else."""
    import tensorflow as tf

    if strategy is None:
        strategy = tf.distribute.get_strategy()
        if _kind(strategy) is None and contract.in_job(os.environ):
            # In a job, outside any scope: the job's strategy (created once per process).
            from ..strategies import strategy as job_strategy

            strategy = job_strategy()
    kind = _kind(strategy)
    if kind is None:
        layout = contract.layout(os.environ)
        where = (
            f"{contract.LAYOUT_VAR}={layout!r} is set but no distribution strategy is active"
            if layout
            else "this process is not part of a keras_distrib job (no TF_CONFIG / strategy)"
        )
        raise TrainerError(
            f"keras_distrib training needs a ParameterServerStrategy or "
            f"MultiWorkerMirroredStrategy, got {type(strategy).__name__}: {where}. "
            f"HINT: {RUN_HINT} Or pass strategy= explicitly."
        )
    if kind not in allow:
        raise TrainerError(
            f"this trainer serves the {'/'.join(allow)} layout(s) but the strategy is "
            f"{type(strategy).__name__} ({kind}). HINT: use keras_distrib.fit(), which picks "
            "the trainer matching the layout, or launch with the matching --layout."
        )
    return strategy


def check_model(model: Any, strategy: Any) -> Any:
    """Validate that ``model`` is built and compiled for ``strategy``; return its optimizer."""
    if not getattr(model, "built", False) or not model.variables:
        raise TrainerError(
            "the model has no variables yet. HINT: give it an `keras.Input(...)` (or call "
            "`model.build(input_shape)`) inside `with strategy.scope():` before fit()."
        )
    opt = getattr(model, "optimizer", None)
    if opt is None or private.compiled_loss(model) is None and not _overrides_loss(model):
        raise TrainerError(
            "the model is not compiled with an optimizer and a loss. HINT: call "
            "`model.compile(optimizer=..., loss=..., metrics=[...])` inside the strategy scope."
        )
    opt_strategy = private.optimizer_strategy(opt)
    if opt_strategy is not None and opt_strategy is not strategy:
        raise TrainerError(
            "the optimizer was created outside the distribution strategy scope (TensorFlow "
            "then mixes two strategies when applying gradients). HINT: create the optimizer "
            "and call `model.compile(...)` inside `with strategy.scope():`."
        )
    model_var = model.trainable_variables[0] if model.trainable_variables else None
    if model_var is not None and _kind(strategy) == "ps" and "/job:ps" not in _device(model_var):
        raise TrainerError(
            "the model's variables are not on the parameter servers (device "
            f"{_device(model_var)!r}). HINT: build the model inside `with strategy.scope():` "
            "or with keras_distrib.trainers.placement.build(model_fn, strategy)."
        )
    return opt


#: Keras loops that cannot run under ParameterServerStrategy, and what to call instead.
KERAS_LOOPS = ("fit", "evaluate", "predict")


def refuse_keras_loops(model: Any) -> None:
    """Make ``model.fit``/``evaluate``/``predict`` of a parameter-server model raise one clear error.

    Upstream, they fail deep inside TensorFlow ("To use this dataset, you need to pass this
    dataset to ClusterCoordinator.create_per_worker_dataset"). Instance attributes shadow
    the bound methods (nothing is saved with the model; ``keras.Model.fit(model, ...)``
    still reaches Keras' own method).
    """
    for name in KERAS_LOOPS:
        setattr(model, name, _refusal(name))


def _refusal(name: str) -> Any:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise TrainerError(
            f"model.{name}() cannot run on a model built for the parameter-server layout "
            "(Keras' loops do not drive TensorFlow's ParameterServerStrategy). "
            f"HINT: call keras_distrib.{name}(model, ...) with the same arguments."
        )

    refuse.__name__ = name
    refuse.__doc__ = f"Refused under the parameter-server layout: use keras_distrib.{name}(model, ...)."
    return refuse


def _overrides_loss(model: Any) -> bool:
    """True if the model computes its own loss (``compute_loss`` or a whole ``train_step``)."""
    import keras

    cls = type(model)
    return cls.compute_loss is not keras.Model.compute_loss or cls.train_step is not keras.Model.train_step


def _device(v: Any) -> str:
    return getattr(getattr(v, "value", v), "device", "") or ""


class CheckpointKeeper:
    """tf.train.Checkpoint(model, optimizer, step), saved and restored through
    `keras_distrib.checkpoints.Checkpointer` (atomic, newest complete one, metadata).

    Only the chief writes; other all-reduce workers take part in the save (TensorFlow
    requires it) without writing into the directory.
    """

    def __init__(self, directory: str, model: Any, optimizer: Any, step: Any, *, is_chief: bool, max_to_keep: int = 3) -> None:
        import tensorflow as tf

        from ..checkpoints import Checkpointer

        self.is_chief = is_chief
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
        self.checkpointer = Checkpointer(directory, self.checkpoint, model, writer=is_chief, keep=max_to_keep)

    def restore(self) -> bool:
        """Restore the newest complete checkpoint of ``directory`` (all workers read the chief's)."""
        return self.checkpointer.restore() is not None

    def save(self, step: int) -> None:
        self.checkpointer.save(step)

    def close(self) -> None:
        """Nothing to release (kept for the trainers' try/finally)."""


def empty_like(spec: Any) -> Any:
    """Zeros of a ``tf.TensorSpec``'s shape and dtype, each unknown dimension 0 (an empty batch)."""
    import tensorflow as tf

    return tf.zeros([0 if d is None else d for d in spec.shape], spec.dtype)


class FitStream:
    """One input object for epochs ``first`` .. ``last`` of a fit, made once by
    ``make(first, last)`` and handed out again for each of those epochs."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._held: tuple[int, int, Any] | None = None  # (first epoch, last epoch, the object)

    def get(self, epoch: int, last: int) -> Any:
        if self._held is None or not self._held[0] <= epoch <= last or self._held[1] != last:
            self._held = (epoch, last, self._make(epoch, last))
        return self._held[2]

    def drop(self) -> None:
        """Make it anew at the next `get` (an epoch stopped before its end)."""
        self._held = None
