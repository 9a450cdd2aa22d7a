"""Every private Keras/TensorFlow API the jax layouts (jax_distribution.py) and the servers
(servers.py) use, each with the upstream limitation it works around. Nothing else in
keras_distrib outside the trainers' own fence (trainers/_private_apis.py) touches a private name (tests/unit/
test_import_boundaries.py checks it), so an upgrade only has to re-check the fenced modules
against `TESTED_VERSIONS`.
"""

from __future__ import annotations

from typing import Any

#: The releases these private uses were checked against (pyproject.toml bounds the minors).
TESTED_VERSIONS = {"tensorflow": "2.21.0", "keras": "3.15.1", "jax": "0.10.2", "keras_tuner": "1.4.8"}


def agree_on_random_seed() -> None:
    """Give every jax process the same Keras random seed (so all create the same weights),
    as ``keras.distribution.initialize()`` does after ``jax.distributed.initialize``.

    Upstream: ``keras.distribution.initialize()`` cannot pass ``jax.distributed.initialize``
    the ``local_device_ids``, ``cluster_detection_method`` and ``initialization_timeout``
    the launcher's plan needs, and Keras offers its cross-process seed agreement
    (``keras.src.backend.jax.distribution_lib.initialize_rng``) only through that call.
    """
    from keras.src.backend.jax.distribution_lib import initialize_rng

    initialize_rng()


def declared_batch_size(dataset: Any) -> int | None:
    """The size given to ``.batch()`` (the last batch may be smaller), or None if unknown.

    Upstream: a dataset's ``element_spec`` has no batch size when the last batch may be
    partial, and no public API reads the ``.batch()`` op; this is the helper Keras' own
    ``distribute_tf_dataset`` uses (``tf.data.experimental`` internals).
    """
    from tensorflow.python.data.experimental.ops import distribute as tf_data_distribute

    try:
        size = int(tf_data_distribute.compute_batch_size(dataset).numpy())
    except Exception:  # an unusual pipeline: the caller only loses a warning
        return None
    return size if size > 0 else None


def tf_key_value_store() -> Any:
    """The TensorFlow runtime's context, whose ``set_config_key_value`` and
    ``get_config_key_value(key, timeout_in_ms)`` reach the coordination service's
    key-value store (used by `keras_distrib.once` in the all-reduce layout).

    Upstream: MultiWorkerMirroredStrategy starts the coordination service every worker
    joins, but TensorFlow exposes its key-value store only on the private eager context.
    """
    from tensorflow.python.eager import context

    return context.context()


def jax_key_value_store() -> Any:
    """JAX's distributed-runtime client (``key_value_set``, ``blocking_key_value_get(key,
    timeout_in_ms)``), used by `keras_distrib.once` in the jax layouts.

    Upstream: ``jax.distributed.initialize`` connects the client every process shares, but
    JAX exposes it only as ``jax._src.distributed.global_state.client``.
    """
    from jax._src.distributed import global_state

    return global_state.client


def initial_epoch(model: Any) -> int:
    """The epoch ``fit`` starts from after ``BackupAndRestore`` restored a backup.

    Upstream: ``BackupAndRestore`` (Keras 3) tells ``fit`` where to start by setting the
    private ``model._initial_epoch``; no public API reads it back.
    """
    return int(getattr(model, "_initial_epoch", 0) or 0)


def write_backups_to(callback: Any, directory: str) -> None:
    """Make a ``keras.callbacks.BackupAndRestore`` write its files to ``directory`` from now on.

    Upstream: the callback reads and writes one ``backup_dir`` (its private ``_weights_path``
    and ``_training_metadata_path``, set in ``__init__``); on JAX every process must save
    (``save_weights`` is a collective) but only one may write the shared directory.
    """
    import os

    callback.backup_dir = directory
    callback._weights_path = os.path.join(directory, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(directory, "training_metadata.json")
    callback._prev_weights_path = f"{callback._weights_path}.bkp"
    callback._prev_training_metadata_path = f"{callback._training_metadata_path}.bkp"


def save_backups_whole(callback: Any) -> None:
    """Make a ``keras.callbacks.BackupAndRestore`` replace its files whole: each save is written
    to ``backup_dir/.writing`` and moved over the old files (weights first, then the epoch), so
    a process killed while it saves leaves the previous backup whole.

    Upstream: ``BackupAndRestore._save_model`` writes ``latest.weights.h5`` in place; a chief
    stopped during that write (a re-forming job stops every process) left a file that no
    process could open ("bad object header version number") and the job failed at its restart.
    """
    import os

    save = callback._save_model
    final = callback.backup_dir

    def save_whole() -> None:
        writing = os.path.join(final, ".writing")
        write_backups_to(callback, writing)
        try:
            save()
            for name in (os.path.basename(callback._weights_path), os.path.basename(callback._training_metadata_path)):
                os.replace(os.path.join(writing, name), os.path.join(final, name))
        finally:
            write_backups_to(callback, final)

    callback._save_model = save_whole


def server_runtime() -> tuple[Any, Any, Any]:
    """``(Server, ClusterSpec, list_physical_devices)`` for a process that only serves.

    Upstream: ``import tensorflow`` runs the package's ``__init__``, which imports the whole
    public API (``tf.compat.v1``, TF Lite, Keras eagerly, ...) that a ps or worker server
    never calls: about 4 CPU s per server here, against 1 s for the runtime modules a server
    uses, ``tensorflow.python.training.server_lib`` and ``tensorflow.python.framework.config``.
    Those are reached under a bare ``tensorflow`` package module (its ``__init__`` not run);
    of what that ``__init__`` does, the TF2 behaviour is done here, and where it would load
    more (first-party kernel or pluggable-device plugins, a modular filesystem), or the
    installed TensorFlow is not the release checked, the whole ``import tensorflow`` runs.
    """
    import importlib.util
    import sys

    spec = None if "tensorflow" in sys.modules else importlib.util.find_spec("tensorflow")
    if spec is None or not _bare_import_is_enough(spec):
        import tensorflow as tf

        return tf.distribute.Server, tf.train.ClusterSpec, tf.config.list_physical_devices
    sys.modules["tensorflow"] = importlib.util.module_from_spec(spec)
    from tensorflow.python.compat import v2_compat
    from tensorflow.python.framework import config
    from tensorflow.python.training import server_lib

    v2_compat.enable_v2_behavior()
    return server_lib.Server, server_lib.ClusterSpec, config.list_physical_devices


def is_cuda_build() -> bool:
    """Whether the installed TensorFlow was built with CUDA, without the whole ``import
    tensorflow`` (a server imports only its runtime, `server_runtime`).

    Upstream: ``tf.test.is_built_with_cuda()`` is public, but ``tf.test`` exists only once
    ``tensorflow/__init__.py`` ran; the same fact is ``is_cuda_build`` in
    ``tensorflow.python.platform.build_info`` (checked with TF 2.21).
    """
    from tensorflow.python.platform import build_info

    return bool(build_info.build_info.get("is_cuda_build"))


def _bare_import_is_enough(spec: Any) -> bool:
    """No plugin or filesystem that ``tensorflow/__init__.py`` (found at ``spec``) would load,
    and the release this was checked against (see `server_runtime`)."""
    import importlib.metadata
    import os
    import site
    import sys

    try:
        release = importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:  # tensorflow-cpu, tf-nightly, a source build
        return False
    if spec.origin is None or release.split(".")[:2] != TESTED_VERSIONS["tensorflow"].split(".")[:2]:
        return False
    if os.environ.get("TF_USE_MODULAR_FILESYSTEM", "0") in ("true", "1") or os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH"):
        return False
    # As tensorflow/__init__.py looks (an old virtualenv's site module has no getsitepackages).
    site_dirs = [p for p in sys.path if "site-packages" in p] + list(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE and site.USER_SITE:
        site_dirs.append(site.USER_SITE)
    plugins = [os.path.join(os.path.dirname(spec.origin), "core", "kernels")]
    plugins += [os.path.join(d, "tensorflow-plugins") for d in site_dirs]
    return not any(os.path.exists(path) for path in plugins)


def limit_oracle_wait(seconds: float) -> None:
    """Make a KerasTuner trial worker give up on an unreachable oracle after ``seconds``.

    Upstream: KerasTuner 1.4's ``OracleClient`` waits up to an hour for the chief on every
    call (``keras_tuner.src.distribute.oracle_client.TIMEOUT``); a worker that asks the
    oracle for results after the search, when the chief has already exited, would hang
    that long. No public setting exists.
    """
    from keras_tuner.src.distribute import oracle_client

    oracle_client.TIMEOUT = seconds


def serve_oracle(report: Any, poll: float) -> Any:
    """On the oracle's process: call ``report(oracle, tuner_id, trial_id)`` after each trial a
    worker reports ended, notice the search's end within ``poll`` seconds, and keep serving
    after it. Returns a function giving the seconds since the oracle last answered a worker
    (None before it serves).

    Upstream: KerasTuner 1.4's chief serves the workers through
    ``keras_tuner.src.distribute.oracle_chief``; no public hook sees which worker ended which
    trial. Its ``start_server`` checks every 20 s (``time.sleep(20)``) whether the last worker
    has gone, and stops serving when it returns, so a worker asking for results after its
    search (``tuner.results_summary()``) finds no oracle once the chief has moved on.
    """
    import time as real_time
    import types

    import grpc
    from keras_tuner.src.distribute import oracle_chief

    last: list[float] = []
    servers: list[Any] = []  # held, so the server outlives start_server (its only reference)

    def answered(method: Any) -> Any:
        def call(self: Any, request: Any, context: Any) -> Any:
            if method.__name__ != "EndTrial":
                response = method(self, request, context)
                last[:] = [real_time.monotonic()]
                return response
            ended = request.trial.trial_id  # whose it was: known only before the oracle ends it
            tuner_id = next((t for t, trial in self.oracle.ongoing_trials.items() if trial.trial_id == ended), "?")
            response = method(self, request, context)
            last[:] = [real_time.monotonic()]
            try:
                report(self.oracle, tuner_id, ended)
            except Exception:  # a progress line must never fail the search
                pass
            return response
        return call

    servicer = oracle_chief.OracleServicer
    for name in ("GetSpace", "UpdateSpace", "CreateTrial", "UpdateTrial", "EndTrial", "GetTrial", "GetBestTrials"):
        setattr(servicer, name, answered(getattr(servicer, name)))

    def server(*args: Any, **kwargs: Any) -> Any:
        servers.append(grpc.server(*args, **kwargs))
        last[:] = [real_time.monotonic()]
        return servers[-1]

    oracle_chief.grpc = types.SimpleNamespace(server=server)
    oracle_chief.time = types.SimpleNamespace(sleep=lambda s: real_time.sleep(min(s, poll)))
    return lambda: real_time.monotonic() - last[0] if last else None
