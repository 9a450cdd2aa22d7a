"""Coordination between the processes that run SCRIPT: ``keras_distrib.once(fn)``.

In the synchronous layouts (``allreduce``, ``jax``, ``jax-per-gpu``) every process runs
SCRIPT, so a step that writes files (downloading, converting to TFRecord) would run once
per process, concurrently, into the same files. ``once(fn)`` runs ``fn`` on the first
process of the job (or of each node, ``per_node=True``, for files on node-local disks) and
makes the others wait until it has finished, then returns on every process.

How the others learn that it finished: the key-value store of the job's own distributed
runtime, which every process of these layouts already joined (TensorFlow's coordination
service, started by ``MultiWorkerMirroredStrategy``; JAX's distributed client, started by
``jax.distributed.initialize``). The process that runs ``fn`` sets a key to ``ok``, or to
the error it raised; the others block on that key with a timeout. Nothing is written to
disk, nothing depends on a shared file system, and a key belongs to one launch (a rerun or
a requeue starts a new runtime), so a stale marker from an earlier run cannot release a
waiting process early. The n-th ``once`` call of each process uses the n-th key: every
process must make the same calls in the same order (they run the same SCRIPT).

In the parameter-server layouts only the chief runs SCRIPT: ``fn`` simply runs there.

Upstream offers no public access to either store: both are reached through
``keras_distrib/_private_apis.py``.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Callable

from . import _private_apis as private
from . import contract
from .plan import JAX_LAYOUTS

__all__ = ["once", "OnceError", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

#: Seconds a waiting process waits by default (data preparation can be long).
DEFAULT_TIMEOUT = 3600.0
_KEY_PREFIX = "keras_distrib/once"
_OK = "ok"
_FAILED = "failed:"
_calls = itertools.count()


class OnceError(RuntimeError):
    """Raised on a waiting process when ``fn`` failed on the process that ran it, or took too long."""


def once(fn: Callable[[], Any], *, per_node: bool = False, timeout: float | None = DEFAULT_TIMEOUT,
         name: str | None = None) -> Any:
    """Run ``fn()`` on one process of the job (of each node with ``per_node``); the others wait.

    Returns ``fn``'s result on the process that ran it and None on the others, once it
    finished. If ``fn`` raises, that process re-raises it and every waiting process raises
    `OnceError` naming the process and the error. A process still waiting after
    ``timeout`` seconds (None: forever) raises `OnceError`. Call it with the same calls in
    the same order on every process (they run the same SCRIPT). Outside a job, and in the
    parameter-server layouts (only the chief runs SCRIPT), ``fn`` runs at once.
    """
    if not callable(fn):
        raise TypeError(f"keras_distrib.once(fn): fn={fn!r} is not callable. HINT: pass the function itself, "
                        "e.g. keras_distrib.once(prepare) or keras_distrib.once(lambda: prepare(path)).")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"keras_distrib.once: timeout={timeout!r} must be a positive number of seconds. "
                         "HINT: timeout=3600 (the default), or None to wait forever.")
    label = name or getattr(fn, "__qualname__", None) or repr(fn)
    if not contract.in_job(os.environ):
        return fn()
    from .logs import configure_script
    from .strategies import cluster

    configure_script()
    info = cluster()
    plan = info.plan
    if not plan.every_process_runs_script:
        if per_node and len(plan.nodes) > 1:
            logger.warning(f"keras_distrib.once({label}, per_node=True): in layout {plan.layout} only the chief runs "
                           f"SCRIPT, so it runs on the chief's node ({plan.find(info.job, info.index).node}) only; the "
                           "workers on the other nodes run no SCRIPT. HINT: write node-local files in the job script "
                           "before the launcher starts (e.g. one srun per node), or put them on a shared file system.")
        return fn()
    me = plan.find(info.job, info.index)
    runners = plan.script_runners
    if per_node:
        runners = [p for p in runners if p.node == me.node]
    leader = runners[0]
    scope = f"node/{me.node}" if per_node else "job"
    key = f"{_KEY_PREFIX}/{next(_calls)}/{scope}"
    if len(runners) == 1:  # nobody waits
        return fn()
    store = _store(plan.layout)
    who = f"{leader.name} on {leader.node}"
    if me == leader:
        try:
            result = fn()
        except BaseException as exc:
            store.set(key, f"{_FAILED}{type(exc).__name__}: {_first_line(exc)}")
            raise
        store.set(key, _OK)
        return result
    logger.debug(f"keras_distrib.once({label}): waiting for {who}")
    try:
        value = store.get(key, timeout)
    except TimeoutError:
        raise OnceError(
            f"keras_distrib.once({label}): {me.name} waited timeout={timeout:g} s for {who} to finish it. "
            f"HINT: see {who}'s output for why it is still running or stopped; raise once(..., timeout=...) "
            "if it needs longer."
        ) from None
    except Exception as exc:  # the runtime lost the process that runs fn (it died, or the job is ending)
        raise OnceError(
            f"keras_distrib.once({label}): {me.name} lost {who} while waiting for it ({type(exc).__name__}: "
            f"{_first_line(exc)}). HINT: see {who}'s output for the cause."
        ) from None
    if value != _OK:
        raise OnceError(
            f"keras_distrib.once({label}) failed on {who} ({value[len(_FAILED):]}); {me.name} did not run it. "
            f"HINT: fix the error in {who}'s traceback, then rerun."
        )
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


class _TFStore:
    """TensorFlow's coordination-service key-value store (the all-reduce layout)."""

    def __init__(self) -> None:
        from .strategies import strategy

        strategy()  # MultiWorkerMirroredStrategy starts the coordination service (cached per process)
        self._context = private.tf_key_value_store()

    def set(self, key: str, value: str) -> None:
        self._context.set_config_key_value(key, value)

    def get(self, key: str, timeout: float | None) -> str:
        import tensorflow as tf

        try:
            return self._context.get_config_key_value(key, 0 if timeout is None else max(1, int(timeout * 1000)))
        except tf.errors.DeadlineExceededError:
            raise TimeoutError(key) from None


class _JaxStore:
    """JAX's distributed-runtime key-value store (the jax layouts)."""

    def __init__(self) -> None:
        from .jax_distribution import distribution

        distribution()  # joins the job (cached per process)
        self._client = private.jax_key_value_store()

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def get(self, key: str, timeout: float | None) -> str:
        # JAX takes an int of milliseconds; "forever" is a very long wait.
        ms = 2**31 - 1 if timeout is None else max(1, min(int(timeout * 1000), 2**31 - 1))
        try:
            return self._client.blocking_key_value_get(key, ms)
        except Exception as exc:
            if "DEADLINE_EXCEEDED" in str(exc) or "Deadline" in str(exc):
                raise TimeoutError(key) from None
            raise


def _store(layout: str) -> Any:
    return _JaxStore() if layout in JAX_LAYOUTS else _TFStore()
