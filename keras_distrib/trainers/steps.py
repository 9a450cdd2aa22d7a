"""The step contract shared by the trainers: which step runs, Keras' compile knobs, defaults.

Keras' backend trainers (``keras/src/backend/tensorflow/trainer.py``) give every model
``train_step``/``test_step``/``predict_step`` and compile each into a function that runs
``steps_per_execution`` of them. Our trainers do the same with their own default steps
(exact sums over workers, see `metrics`), except where the user's model class overrides
a step: then that method runs for every step, as Keras' guide "Customizing what happens
in fit()" promises, and what it returns is what History and the callbacks see.

Nothing here imports TensorFlow at import time.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ._common import TrainerError, empty_like
from .metrics import all_finite, pythonify_logs

#: Steps run inside one scheduled/compiled function when neither ``keras_distrib.fit``
#: nor ``model.compile(steps_per_execution=...)`` says (measured: docs/performance-history.md).
DEFAULT_STEPS_PER_EXECUTION = 10

#: Examples per batch when ``batch_size`` is not given (Keras' default).
DEFAULT_BATCH_SIZE = 32

#: The step methods a Keras model may override, and the loop each one serves.
STEP_METHODS = {"train_step": "fit", "test_step": "evaluate/validation", "predict_step": "predict"}


def overridden_steps(model: Any) -> frozenset[str]:
    """The step methods ``type(model)`` overrides relative to ``keras.Model``."""
    import keras

    cls = type(model)
    return frozenset(name for name in STEP_METHODS
                     if getattr(cls, name, None) is not getattr(keras.Model, name))


def refuse_custom_step_modes(model: Any, *, stale_reads: bool, local_steps: bool) -> None:
    """One error before training when an opt-in mode cannot run the model's own ``train_step``."""
    if "train_step" not in overridden_steps(model):
        return
    for option, on in (("ps_local_steps", local_steps), ("ps_stale_reads", stale_reads)):
        if on:
            raise TrainerError(
                f"{type(model).__name__} overrides train_step, which {option}=True cannot run ({option} "
                "replaces the step with its own gradient computation on a local copy of the weights). "
                f"HINT: drop {option} (the default parameter-server step runs your train_step), or move "
                "the custom logic into compute_loss, which every mode runs."
            )


def steps_per_execution(model: Any, given: int | None) -> int:
    """Steps per function: ``keras_distrib.fit``'s argument, else the model's compiled value
    when it is not Keras' default 1, else `DEFAULT_STEPS_PER_EXECUTION`."""
    if given is not None:
        return max(1, int(given))
    compiled = getattr(model, "steps_per_execution", 1)
    try:
        compiled = int(compiled)
    except (TypeError, ValueError):
        compiled = 1
    return compiled if compiled > 1 else DEFAULT_STEPS_PER_EXECUTION


def check_compile_knobs(model: Any) -> None:
    """Refuse (one line + HINT) the ``compile`` settings the trainers cannot honour."""
    if getattr(model, "run_eagerly", False):
        raise TrainerError(
            "the model is compiled with run_eagerly=True, which keras_distrib's distributed trainers cannot "
            "honour (their steps run as compiled functions on the workers). HINT: compile without run_eagerly, "
            "or debug eagerly with plain model.fit outside a job (keras_distrib.fit does that when run without "
            "the launcher)."
        )
    if getattr(model, "jit_compile", False) is True:
        raise TrainerError(
            "the model is compiled with jit_compile=True (XLA), which keras_distrib's distributed trainers do "
            "not honour. HINT: compile with jit_compile=False (or leave the default \"auto\", which Keras "
            "turns off under tf.distribute)."
        )


def compiled(fn: Callable[..., Any], *, retrace_less: bool = False) -> Any:
    """Every function a trainer runs in a graph goes through here, as Keras' backend trainer
    compiles its ``multi_step_on_iterator``: the chunk of K steps, the predict chunk, the
    user's own step (`compiled_step`) and the small collective helpers.

    Never converted by AutoGraph, as Keras' own steps (its ``do_not_convert``): the user's
    code is traced as the Python it is, and our loops and branches are written as
    ``tf.while_loop``/``tf.cond`` (converting cost every process seconds of its first
    trace: docs/performance-history.md). ``retrace_less``: ``reduce_retracing`` for functions
    called with varying shapes (predict batches, the user's step). Never ``jit_compile``:
    XLA cannot compile the ps trainers' remote reads (`check_compile_knobs` refuses it
    with a HINT).
    """
    import tensorflow as tf

    return tf.function(tf.autograph.experimental.do_not_convert(fn), reduce_retracing=retrace_less)


#: model -> {step method: {top-level key of what the step returns: the metric whose
#: ``result()`` it is}}, found when the step is traced (`noting_metric_results`).
_RESULT_KEYS: "weakref.WeakKeyDictionary[Any, dict[str, dict[str, str]]]" = weakref.WeakKeyDictionary()


def noting_metric_results(step: Callable[[Any], Any], run: Callable[[Callable[[Any], Any], Any], Any] | None = None
                          ) -> Callable[[Any], Any]:
    """``data -> run(step, data)`` (``run`` default: a plain call; the trainers pass
    ``strategy.run``), noting which top-level values the model's bound train_step/test_step
    ``step`` returns are a metric's ``result()`` as it gave them: those are read over every
    worker at the epoch's end (`epoch_logs`), the others are the step's own. The metrics are
    patched around the whole ``run``, not per replica: replicas run in threads at once."""
    model, name = getattr(step, "__self__", None), getattr(step, "__name__", "")
    run = run or (lambda fn, data: fn(data))
    if model is None:
        return lambda data: run(step, data)

    def noting(data: Any) -> Any:
        made: dict[int, str] = {}
        returned: list[Any] = []

        def stepping(batch: Any) -> Any:
            out = step(batch)
            returned.append(out)
            return out

        metrics = list(getattr(model, "metrics", []))
        for metric in metrics:
            def result(*args: Any, _metric: Any = metric, _own: Any = metric.result, **kwargs: Any) -> Any:
                value = _own(*args, **kwargs)
                if not isinstance(value, dict):
                    made[id(value)] = _metric.name
                return value

            object.__setattr__(metric, "result", result)
        try:
            out = run(stepping, data)
        finally:
            for metric in metrics:
                object.__delattr__(metric, "result")
        if returned and isinstance(returned[0], dict):
            keys = {k: made[id(v)] for k, v in returned[0].items() if not isinstance(v, dict) and id(v) in made}
            _RESULT_KEYS.setdefault(model, {})[name] = keys
        return out

    return noting


def compiled_step(step: Callable[[Any], Any], strategy: Any, reduce: Callable[[Any], Any] | None = None) -> Any:
    """``data -> reduce(strategy.run(step, data))`` as a tf.function, as Keras compiles its
    ``one_step_on_data``: traced once (the user's Python runs at trace time, as in Keras)
    and called from the trainers' chunk functions. Not converted by AutoGraph, as in Keras
    (its ``do_not_convert``): the user's step is traced as the Python it is."""
    noted = noting_metric_results(step, lambda fn, data: strategy.run(fn, args=(data,)))

    def one_step(data: Any) -> Any:
        out = noted(data)
        return out if reduce is None else reduce(out)

    return compiled(one_step, retrace_less=True)


def mean_over_replicas(strategy: Any, values: Any) -> Any:
    """What a step returned on each replica, as one value: the mean over every replica (of
    every worker), which is what Keras' TensorFlow trainer means by its "auto" reduction
    (``reduce_per_replica``: ``tf.reduce_mean`` over the local replicas; its multi-worker
    branch, ``strategy.reduce("MEAN", v, axis=0)``, fails on the scalars steps return)."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None), values)


def output_zeros(fn: Any, data: Any) -> Any:
    """Zeros shaped like the outputs of the tf.function ``fn`` on ``data`` (traced, not run):
    the value a chunk carries before its first step (a step that found no input keeps it)."""
    import tensorflow as tf

    outputs = fn.get_concrete_function(data).structured_outputs

    def zeros(t: Any) -> Any:
        if t.shape.rank is None:
            raise TrainerError(
                f"the step returns a value of unknown rank ({t!r}). HINT: return scalars or tensors of "
                "known rank from train_step/test_step (Keras returns the metrics' results)."
            )
        return empty_like(t)

    return tf.nest.map_structure(zeros, outputs)


class _BuildFirst(Exception):
    """Raised inside a trace when an unbuilt optimizer is first used (see `first_trace`)."""


def first_trace(model: Any, strategy: Any, fn: Any, data: Any) -> Any:
    """`output_zeros` of the step ``fn``, after building every optimizer the step uses.

    Keras builds an optimizer's slots on its first ``apply``, inside the traced step; a
    mirrored variable (all-reduce with several replicas per worker) cannot be created
    there ("Unable to lift tensor ... replica_1/Initializer"), so a GAN's second optimizer
    would fail. Each unbuilt optimizer's ``build`` is intercepted during a trace (which
    stops there), then called eagerly under the strategy with the variables the step
    gave it, until a trace completes.
    """
    for _ in range(len(step_optimizers(model)) + 1):
        pending = [o for o in step_optimizers(model) if not o.built]
        wanted: list[tuple[Any, list[Any]]] = []

        def recorder(optimizer: Any) -> Any:
            def build(variables: Any) -> None:
                wanted.append((optimizer, list(variables)))
                raise _BuildFirst

            return build

        for optimizer in pending:
            optimizer.build = recorder(optimizer)  # an instance attribute shadows the method
        try:
            return output_zeros(fn, data)
        except _BuildFirst:
            pass
        finally:
            for optimizer in pending:
                vars(optimizer).pop("build", None)
        with strategy.scope():
            for optimizer, variables in wanted:
                optimizer.build(variables)
    return output_zeros(fn, data)


def logs_finite(logs: Any) -> Any:
    """True if every floating value the step returned is finite (traced)."""
    import tensorflow as tf

    return all_finite([tf.convert_to_tensor(t) for t in tf.nest.flatten(logs)])


def step_data(x: Any) -> Any:
    """The ``data`` Keras' ``predict`` passes to ``predict_step`` for an input batch ``x``
    (``x`` itself; a tuple/list of inputs wrapped as ``(x,)``, Keras' own packing)."""
    return (x,) if isinstance(x, (list, tuple)) else x


def epoch_logs(model: Any, last: Any, method: str = "train_step") -> dict[str, Any]:
    """Keras' rule for the logs of an epoch of the model's own steps
    (``Trainer._get_metrics_result_or_logs``): when the keys the last step returned are the
    model's metric names, the metric results, read now over every worker's updates; else the
    last step's logs. In those, a metric's result (a value the step returned as
    ``metric.result()`` gave it, or a nested dict of results such as ``compile_metrics``) is
    read now over every worker too, while a value the step computed itself stays its own
    (``{"compile_metrics": ..., "loss": loss + 100}`` reports loss + 100, as Keras does)."""
    try:
        metric_logs = pythonify_logs(model.get_metrics_result())
    except Exception:  # noqa: BLE001 - an unbuilt metric: keep the step's own logs
        metric_logs = {}
    if not isinstance(last, dict):
        return pythonify_logs(last)
    # The raw keys, as Keras compares them: flattened, a nested "loss" would hide the step's own.
    if metric_logs and set(last) == set(metric_logs):
        return metric_logs
    results = _RESULT_KEYS.get(model, {}).get(method, {})
    logs: dict[str, Any] = {}
    for key, value in sorted(last.items()):  # Keras' flattening order: a later key overrides
        if isinstance(value, dict):
            logs.update({k: metric_logs.get(k, v) for k, v in pythonify_logs(value).items()})
        else:
            own = pythonify_logs({key: value})[key]
            logs[key] = metric_logs.get(results[key], own) if key in results else own
    return logs


def step_optimizers(model: Any) -> list[Any]:
    """``model.optimizer`` and every Keras optimizer held in an attribute of the model
    (a GAN's ``d_optimizer``/``g_optimizer``)."""
    import keras

    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found):
            found.append(value)
    return found
