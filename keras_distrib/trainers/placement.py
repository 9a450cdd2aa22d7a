"""Balancing variables over parameter-server tasks by size.

ParameterServerStrategy places variables round-robin in creation order, which for a
Keras model puts every kernel on ps0 and every bias on ps1. We instead:

1. dry-run ``model_fn`` outside any strategy to record the creation order and size of
   every variable (cheap: it only allocates the initial values once on this process);
2. plan with the greedy "largest first onto the least loaded ps" rule (LPT);
3. run ``model_fn`` again under ``strategy.scope()`` with a variable creator that wraps
   the i-th creation in ``tf.device(<planned ps>)``.

Variables created later (optimizer iteration/learning-rate, step counters) go to the
currently least loaded ps. Optimizer slots are colocated with their model variable by
Keras itself. No partitioners: ShardedVariable breaks Keras 3.
"""

from __future__ import annotations

import contextlib
import heapq
import weakref
from typing import Any, Callable, Iterator, Sequence

__all__ = ["plan_placement", "BalancedPlacer", "build"]


def plan_placement(sizes: Sequence[int], num_ps: int) -> list[int]:
    """ps index for each size: largest first, each onto the currently lightest ps."""
    if num_ps < 1:
        raise ValueError("num_ps must be >= 1")
    heap = [(0, ps) for ps in range(num_ps)]
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, ps = heapq.heappop(heap)
        out[i] = ps
        heapq.heappush(heap, (load + sizes[i], ps))
    return out


def _num_elements(shape: Any) -> int:
    import tensorflow as tf

    n = tf.TensorShape(shape).num_elements()
    return 1 if n is None else int(n)


def _record_sizes(model_fn: Callable[[], Any]) -> list[tuple[int, Any]]:
    """(size, shape) of each variable ``model_fn`` creates, in creation order."""
    import tensorflow as tf

    seen: list[tuple[int, Any]] = []

    def recorder(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        var = next_creator(**kwargs)
        seen.append((_num_elements(var.shape), tuple(var.shape)))
        return var

    with tf.variable_creator_scope(recorder):
        model_fn()
    return seen


class BalancedPlacer:
    """Variable creator that follows a size plan, then falls back to least-loaded."""

    def __init__(self, num_ps: int, planned: Sequence[tuple[int, Any]] = ()) -> None:
        self.num_ps = num_ps
        self.loads = [0] * num_ps
        self._planned = list(planned)
        self._plan = plan_placement([s for s, _ in planned], num_ps) if planned else []
        self._next = 0

    def _choose(self, shape: tuple[int, ...], size: int) -> int:
        i = self._next
        self._next += 1
        if i < len(self._plan) and tuple(self._planned[i][1]) == shape:
            return self._plan[i]
        # model_fn created something unexpected (or we are past the plan): stay greedy.
        self._plan = []
        return min(range(self.num_ps), key=lambda p: (self.loads[p], p))

    def creator(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        import tensorflow as tf

        if kwargs.get("colocate_with") is not None:  # optimizer slots follow their variable
            return next_creator(**kwargs)
        shape = kwargs.get("shape")
        if shape is None:
            init = kwargs.get("initial_value")
            init = init() if callable(init) else init
            kwargs["initial_value"] = init
            shape = tf.TensorShape(getattr(init, "shape", ()))
        shape = tuple(tf.TensorShape(shape).as_list())
        size = _num_elements(shape)
        ps = self._choose(shape, size)
        self.loads[ps] += size
        with tf.device(f"/job:ps/task:{ps}/device:CPU:0"):
            return next_creator(**kwargs)

    @contextlib.contextmanager
    def scope(self) -> Iterator["BalancedPlacer"]:
        import tensorflow as tf

        with tf.variable_creator_scope(self.creator):
            yield self


def _num_ps(strategy: Any) -> int:
    from ._private_apis import num_ps

    return num_ps(strategy)


#: model -> the placer that built it (later variables such as the step counter use the
#: same loads), kept here rather than as an attribute on the user's model.
_PLACERS: "weakref.WeakKeyDictionary[Any, BalancedPlacer]" = weakref.WeakKeyDictionary()


def build(model_fn: Callable[[], Any], strategy: Any = None) -> Any:
    """Build ``model_fn()`` under ``strategy.scope()`` with variables balanced by size.

    ``model_fn`` should create (and may compile) the model; with a compiled optimizer its
    variables are built too, so they are placed while the planner is active. For a
    non-parameter-server strategy this is just ``with strategy.scope(): model_fn()``.
    In the parameter-server layouts the model's ``fit``/``evaluate``/``predict`` raise one
    error naming ``keras_distrib.fit``/``evaluate``/``predict`` (see `refuse_keras_loops`).
    """
    from ._common import refuse_keras_loops, resolve_strategy, strategy_kind

    if strategy is not None and strategy_kind(strategy) is None:  # single process (outside a job)
        with strategy.scope():
            return _finish(model_fn())
    strategy = resolve_strategy(strategy, allow=("ps", "allreduce", "jax-ps"))
    if strategy_kind(strategy) == "jax-ps":  # JAX places nothing: the trainer puts the variables on the ps
        return model_fn()
    if strategy_kind(strategy) == "ps":
        model = _build_on_ps(model_fn, strategy)
        refuse_keras_loops(model)  # model.fit & co. name keras_distrib.fit & co. instead
        return model
    with strategy.scope():
        return _finish(model_fn())


def _build_on_ps(model_fn: Callable[[], Any], strategy: Any) -> Any:
    num_ps = _num_ps(strategy)
    if num_ps < 2:
        with strategy.scope():
            return _finish(model_fn())
    planned = _record_sizes(model_fn)
    placer = BalancedPlacer(num_ps, planned)
    # The placer must sit *below* the strategy's creator (entered first): the strategy's
    # round-robin creator sets a device scope and ours, called next, overrides it.
    with placer.scope(), strategy.scope():
        model = _finish(model_fn())
    _PLACERS[model] = placer
    return model


def _finish(model: Any) -> Any:
    """Create the compiled optimizer's variables now, under the active scope."""
    opt = getattr(model, "optimizer", None)
    if opt is not None and getattr(model, "built", False) and not getattr(opt, "built", True):
        opt.build(model.trainable_variables)
    return model


def placement_scope(model: Any) -> contextlib.AbstractContextManager:
    """The placer used to build ``model`` (least-loaded for new variables), if any.

    Enter it *before* ``strategy.scope()`` (see `build`).
    """
    placer = _PLACERS.get(model)
    return placer.scope() if placer is not None else contextlib.nullcontext()


def ps_loads(variables: Sequence[Any]) -> dict[str, int]:
    """Elements per device of ``variables`` (for logging and tests)."""
    loads: dict[str, int] = {}
    for v in variables:
        dev = getattr(getattr(v, "value", v), "device", "") or ""
        loads[dev] = loads.get(dev, 0) + _num_elements(v.shape)
    return loads
