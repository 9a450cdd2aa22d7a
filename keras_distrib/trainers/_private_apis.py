"""Every private TensorFlow/Keras API the trainers use, each with the upstream limitation
it works around. Nothing else in keras_distrib.trainers touches a private name, so an
upgrade only has to re-check this module (and `TESTED_VERSIONS`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import warnings
from typing import Any, Callable, Iterator, Sequence

#: The releases these private uses were checked against; a different minor version warns
#: (pyproject.toml bounds the minors too).
TESTED_VERSIONS = {"tensorflow": "2.21.0", "keras": "3.15.1"}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


_warned = False


def warn_if_untested() -> None:
    """One warning if the installed tensorflow/keras minor versions were not tested."""
    global _warned
    if _warned:
        return
    _warned = True
    found = {}
    for name, tested in TESTED_VERSIONS.items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if _minor(version) != _minor(tested):
            found[name] = version
    if found:
        have = ", ".join(f"{k} {v}" for k, v in found.items())
        want = ", ".join(f"{k} {v}" for k, v in TESTED_VERSIONS.items())
        warnings.warn(
            f"keras_distrib.trainers was tested with {want} but found {have}: its private "
            "TensorFlow/Keras uses (keras_distrib/trainers/_private_apis.py) may break. "
            "HINT: pip install 'tensorflow==2.21.*' 'keras==3.15.*'",
            RuntimeWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------- ClusterCoordinator

def coordinator_workers(coordinator: Any) -> Sequence[Any]:
    """The coordinator's worker objects.

    Upstream: ``create_per_worker_dataset`` calls the same dataset function for every
    worker (InputContext(1, 0)), so disjoint shards need one function per worker, which
    only ``coordinator._cluster.workers[i].create_resource`` offers.
    """
    return coordinator._cluster.workers


def per_worker_values(coordinator: Any, makers: Sequence[Callable[[], Any]]) -> Any:
    """PerWorkerValues whose worker ``i`` holds ``makers[i]()`` (made there, again for a
    recovered worker), to pass to `per_worker_iterator` (``args``).

    Upstream: as `per_worker_iterator`; ``create_resource`` resolves each worker's own
    value from a PerWorkerValues argument (a RemoteValue itself is refused).
    """
    from tensorflow.python.distribute.coordinator import values as coord_values

    workers = coordinator_workers(coordinator)
    return coord_values.PerWorkerValues(tuple(w.create_resource(fn) for w, fn in zip(workers, makers)))


def per_worker_iterator(coordinator: Any, make_iterators: Sequence[Callable[..., Any]], dataset: Any,
                        args: tuple[Any, ...] | None = None) -> Any:
    """A PerWorkerDistributedIterator whose worker ``i`` runs ``make_iterators[i](*args)``
    (``args``: `per_worker_values`, each worker given its own).

    Upstream: there is no public way to build a per-worker iterator from different
    functions; the RemoteValues need the iterator ``_type_spec`` that TF's own
    ``PerWorkerDatasetFromDataset`` writes, so that ``schedule`` accepts them.
    ``make_iterators[i]`` is re-run by the coordinator if worker ``i`` is recovered.
    """
    from tensorflow.python.distribute import input_lib
    from tensorflow.python.distribute.coordinator import values as coord_values

    workers = coordinator_workers(coordinator)
    iters = tuple(w.create_resource(fn, args=args) for w, fn in zip(workers, make_iterators))
    spec = input_lib.get_iterator_spec_from_dataset(coordinator.strategy, dataset)
    for rv in iters:
        rv._type_spec = spec
    return coord_values.PerWorkerDistributedIterator(iters)


def closures_run_again(coordinator: Any) -> int:
    """How many closures the coordinator has queued again since its start: a closure whose
    worker failed is put back at the end of the queue, behind closures scheduled after it.

    Upstream: no public count; ``_cluster.closure_queue.put_back`` is wrapped (once) to count.
    """
    closures = coordinator._cluster.closure_queue
    if not hasattr(closures, "_keras_distrib_put_back"):
        original = closures.put_back
        closures._keras_distrib_put_back = 0

        def put_back(closure: Any) -> Any:
            closures._keras_distrib_put_back += 1
            return original(closure)

        closures.put_back = put_back
    return closures._keras_distrib_put_back


def scheduled_concrete_function(coordinator: Any, function: Any, args: tuple[Any, ...]) -> Any:
    """The trace ``coordinator.schedule(function, args=args)`` would run.

    Upstream: ``schedule`` looks the tf.function's trace up again for every closure
    (function-type hashing of the per-worker iterator's spec: ``schedule`` took 3.7 ms of
    the chief's CPU per closure with it, 0.44 ms without, cProfile under load); a ConcreteFunction is scheduled as it
    is. The spec comes from the private helpers ``schedule`` uses, and the trace is made
    in the state ``schedule`` sets (``_being_scheduled``: else every ``strategy.run`` in
    the trace warns that it runs outside ``schedule``).
    """
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.util import nest

    strategy = coordinator.strategy
    replica_args = nest.map_structure(cc._maybe_as_type_spec, cc._select_worker_slice(0, args))
    with strategy.scope(), call_time_captures_in_outer_function():
        strategy.extended._being_scheduled = True
        try:
            return function.get_concrete_function(*replica_args)
        finally:
            strategy.extended._being_scheduled = False


@contextlib.contextmanager
def call_time_captures_in_outer_function() -> Iterator[None]:
    """While tracing, a call-time capture made in a nested graph (a ``tf.cond`` branch, a
    loop body) is made in the outermost function and captured from there as a tensor.

    Upstream: ParameterServerStrategy turns every ``StaticHashTable`` created under its
    scope (Keras' ``StringLookup``, ``IntegerLookup``, ``TextVectorization``) into a
    ``DistributedTable``, a copy per worker whose handle a traced function takes through
    ``FuncGraph.capture_call_time_value``: a placeholder fed, when the coordinator runs
    the function on a worker, with that worker's copy. ``cond_v2`` and ``while_v2`` pass
    only ordinary captures into their branch graphs, so a lookup inside a guarded step
    failed on the worker ("You must feed a value for placeholder tensor
    '.../string_lookup/None_Lookup/Placeholder'"). Only the outermost function is called
    with its call-time values fed, so the placeholder must live there.
    """
    import tensorflow as tf
    from tensorflow.python.framework import func_graph

    original = func_graph.FuncGraph.capture_call_time_value

    def capture(self: Any, closure: Any, spec: Any, key: Any = None, default_value: Any = None,
                placeholder: Any = None) -> Any:
        outer = getattr(self, "outer_graph", None)
        if placeholder is None and isinstance(outer, func_graph.FuncGraph):
            with outer.as_default():
                value = capture(outer, closure, spec, key=key, default_value=default_value)
            return tf.nest.map_structure(self.capture, value)
        return original(self, closure, spec, key=key, default_value=default_value, placeholder=placeholder)

    func_graph.FuncGraph.capture_call_time_value = capture
    try:
        yield
    finally:
        func_graph.FuncGraph.capture_call_time_value = original


def num_ps(strategy: Any) -> int:
    """Number of ps tasks (upstream: ParameterServerStrategy has no public count)."""
    return int(getattr(strategy.extended, "_num_ps", 0) or 0)


# ---------------------------------------------------------------- Keras model internals

def compiled_metrics(model: Any) -> Any:
    """The model's compiled metrics container (upstream: Keras 3 does not expose the
    CompileMetrics object whose stateless_* methods make cross-worker sums exact)."""
    return getattr(model, "_compile_metrics", None)


def sublayers(model: Any) -> list[Any]:
    """Every layer inside ``model``, nested ones included (upstream: ``model.layers`` lists
    the top level only; a ``TextVectorization`` keeps its ``StringLookup`` privately)."""
    flatten = getattr(model, "_flatten_layers", None)
    return list(flatten(include_self=False)) if flatten is not None else list(getattr(model, "layers", []))


def compiled_loss(model: Any) -> Any:
    """The model's compiled loss (None before compile); upstream: no public accessor."""
    return getattr(model, "_compile_loss", None)


def flatten_metrics_in_order(model: Any, logs: dict[str, Any]) -> Any:
    """What ``model.evaluate`` returns without ``return_dict``: the loss alone, else a list
    in ``model.metrics_names`` order (then the other keys sorted). Upstream: Keras computes
    it in the private ``Trainer._flatten_metrics_in_order``; the fallback is its rule."""
    flatten = getattr(model, "_flatten_metrics_in_order", None)
    if flatten is not None:
        return flatten(logs)
    names = [n for n in getattr(model, "metrics_names", []) if n in logs]
    results = [logs[n] for n in names] + [logs[k] for k in sorted(logs) if k not in names]
    return results[0] if len(results) == 1 else results


def optimizer_strategy(optimizer: Any) -> Any:
    """The tf.distribute strategy a Keras 3 optimizer was created under (upstream: the
    TensorFlow optimizer keeps it privately; a mismatch fails late inside apply_gradients)."""
    return getattr(optimizer, "_distribution_strategy", None)


def redirect_tensorboard(callback: Any, directory: str) -> None:
    """Move a TensorBoard callback's already-derived writer paths under ``directory``
    (upstream: TensorBoard computes them from ``log_dir`` in __init__; a non-chief
    all-reduce worker must not write into the chief's directory)."""
    import os

    for attr in ("_log_write_dir", "_train_dir", "_val_dir"):
        if hasattr(callback, attr):
            setattr(callback, attr, os.path.join(directory, os.path.basename(str(getattr(callback, attr)))))


# ---------------------------------------------------------------- Keras optimizer internals

def stateless_optimizer(optimizer: Any, variables: Sequence[Any]) -> Any:
    """A view of ``optimizer`` whose ``apply`` works on a `keras.StatelessScope`'s values.

    Upstream: Keras' TensorFlow optimizer refuses ``stateless_apply`` ("incompatible with
    tf.distribute") and its ``assign*``/``_backend_update_step`` write the tf.Variables
    directly through the strategy. Keras' backend-agnostic base methods do the same math
    through ``Variable.assign`` (which a StatelessScope records), so the view is an
    instance of a subclass of the optimizer's class that takes every method TensorFlow's
    optimizer overrides from ``BaseOptimizer`` instead, and shares the optimizer's
    attributes. ``_var_key`` is computed for ``variables`` up front (TensorFlow's reads the
    tf.Variable, which a StatelessScope hides). Refused (TypeError): optimizers whose own
    code calls TensorFlow's versions through ``super()`` (Keras' Nadam and Muon), and
    gradient accumulation (its ``ops.cond`` shares tensors between branches).
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    cls = type(optimizer)
    if TFOptimizer not in cls.__mro__:
        raise TypeError(f"{cls.__name__} is not a Keras 3 TensorFlow optimizer")
    tf_methods = {n for n, f in TFOptimizer.__dict__.items() if callable(f) and not n.startswith("__")}
    for klass in cls.__mro__[: cls.__mro__.index(TFOptimizer)]:
        clash = sorted(tf_methods & set(klass.__dict__))
        if clash:
            raise TypeError(f"{klass.__name__} overrides TensorFlow-specific optimizer methods ({', '.join(clash)})")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise TypeError("gradient_accumulation_steps is set")
    overrides: dict[str, Any] = {n: BaseOptimizer.__dict__[n] for n in tf_methods if n in BaseOptimizer.__dict__}
    keys = {id(v): optimizer._var_key(v) for v in variables}
    overrides["_var_key"] = lambda self, variable: keys[id(variable)]
    view = object.__new__(type(f"Stateless{cls.__name__}", (cls,), overrides))
    view.__dict__.update(optimizer.__dict__)
    return view


def stateless_apply(view: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """``optimizer.apply(grads, variables)`` through a `stateless_optimizer` view (inside a
    StatelessScope that maps the variables and the optimizer's variables).

    Upstream: Keras exports no name for the backend-agnostic ``BaseOptimizer``
    (``keras.optimizers.Optimizer`` is TensorFlow's subclass of it); its ``apply`` is
    called by name on the view.
    """
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    BaseOptimizer.apply(view, list(grads), list(variables))


def _atomic_assign_add(variable: Any, value: Any) -> Any:
    import tensorflow as tf

    current = variable.value
    if not isinstance(current, tf.Variable):  # inside a StatelessScope: a tensor, Keras' own way
        return type(variable).assign_add(variable, value)
    return current.assign_add(tf.cast(value, current.dtype))


def make_increments_atomic(variable: Any) -> None:
    """Make ``variable.assign_add`` the tf.Variable's own (one op on the variable's device).

    Upstream: Keras 3's ``Variable.assign_add`` is ``assign(self + value)``; Keras'
    optimizer advances ``iterations`` that way after every update, which on a parameter
    server reads the counter to the worker and writes it back each step (and loses
    increments between workers). An instance attribute, so only this variable changes.
    """
    import types

    variable.assign_add = types.MethodType(_atomic_assign_add, variable)


#: Messages of a worker RPC that a peer's failure broke in transit (gRPC INTERNAL), as a
#: healthy worker's result fetch reports it while a worker on another node is killed.
BROKEN_WORKER_RPC = ("Unable to parse request",)


def count_broken_worker_rpcs_as_worker_failures() -> None:
    """Make the coordinator treat a worker RPC broken in transit as that worker's failure: it
    checks the worker, then runs the closure again, as for a lost connection.

    Upstream: TensorFlow's ``cluster_coordinator._is_worker_failure`` decides which errors of a
    closure are a worker's failure (Unavailable, Aborted, and a list of rare ones "observed in
    large-scale testing"); any other error fails every closure in flight and raises at the next
    ``schedule`` or ``join``, ending the chief's ``fit``. Idempotent.
    """
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    upstream = cluster_coordinator._is_worker_failure
    if getattr(upstream, "counts_broken_rpcs", False):
        return

    def is_worker_failure(error: Exception) -> bool:
        text = str(error)
        return upstream(error) or (isinstance(error, tf.errors.InternalError) and "/job:worker" in text
                                   and any(message in text for message in BROKEN_WORKER_RPC))

    is_worker_failure.counts_broken_rpcs = True  # type: ignore[attr-defined]
    cluster_coordinator._is_worker_failure = is_worker_failure


def rows_with_logits(t: Any, real: Any) -> Any:
    """The rows of ``t`` where ``real`` is True, carrying the logits of a sigmoid or softmax
    output. Upstream: Keras' cross-entropies compute from the ``_keras_logits`` its
    activations attach to their output, or from the input of a ``Softmax``/``Sigmoid`` op
    (``backend/tensorflow/nn.py``, ``_get_logits``); a masked tensor has neither, so the
    metrics of the real rows would read other values than on an unpadded batch."""
    import tensorflow as tf

    kept = tf.boolean_mask(t, real)
    logits = getattr(t, "_keras_logits", None)
    if logits is None and getattr(getattr(t, "op", None), "type", None) in ("Softmax", "Sigmoid"):
        logits = t.op.inputs[0]
    if logits is not None:
        kept._keras_logits = tf.boolean_mask(logits, real)
    return kept


def symbolic_build(model: Any, batch: Any) -> None:
    """Keras' own creation of a model's, its compiled loss's and metrics' and its optimizer's
    variables from one batch, as ``fit`` does before its first step (no step runs). Upstream:
    ``Trainer._symbolic_build`` (``keras/src/trainers/trainer.py``) has no public equivalent; a
    JAX ``train_step`` called statelessly needs every one of those variables to exist first."""
    model._symbolic_build(data_batch=batch)
