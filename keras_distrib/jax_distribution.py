"""Inside SCRIPT on the jax layouts: Keras 3 on JAX with ``keras.distribution``.

``distribution()`` joins this process to the job (``jax.distributed.initialize`` with the
launcher's KERAS_DISTRIBUTION_* variables) and sets a ``keras.distribution.DataParallel``
over every device of every process, so plain ``model.fit`` trains data-parallel.

Its ``distribute_dataset`` gives every process the same number of equal batches: each
global batch is cut into one contiguous slice per process, and the few examples of a
batch that do not divide by the device count are left out. Keras' own sharding
(``rebatch`` + ``shard``) gives processes different batch counts when the data does not
divide, and then one process waits forever in a collective ("Your input ran out of data").
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
from typing import Any

from . import _private_apis, contract, gpus
from .logs import configure_script
from .network import is_ip_address
from .plan import JAX_LAYOUTS, Process
from .strategies import NotInJobError, cluster

logger = logging.getLogger(__name__)

# JAX's own start-up timeout is 300 s; ours (the launcher's watchdog) must speak first.
JAX_TIMEOUT_MARGIN = 60.0


@functools.cache
def distribution() -> Any:
    """The job's initialized DataParallel (also set as Keras' global distribution); once per process.

    Call it before building the model: Keras places the variables when they are created.
    """
    configure_script()
    info = cluster()
    if info.layout not in JAX_LAYOUTS:
        raise NotInJobError(
            f"keras_distrib.distribution() serves the jax layouts, but this job runs layout {info.layout}. "
            "HINT: launch with --layout jax (KERAS_BACKEND=jax), or use keras_distrib.strategy() and "
            "keras_distrib.fit() on the TensorFlow layouts."
        )
    import keras

    if keras.backend.backend() != "jax":
        raise NotInJobError(
            f"Keras runs the {keras.backend.backend()!r} backend, but layout {info.layout} needs JAX. "
            "HINT: do not set KERAS_BACKEND in the script or in ~/.keras/keras.json; the launcher sets KERAS_BACKEND=jax."
        )
    import jax

    env = os.environ
    process_id = int(env[contract.JAX_PROCESS_ID_VAR])
    if process_id != 0:  # process 0's port is JAX's coordinator: listening there means joined
        _announce_joined(info.plan.find(info.job, info.index))
    local_ids = env.get(contract.JAX_DEVICE_IDS_VAR)
    startup_timeout = contract.startup_timeout(env)
    jax.distributed.initialize(
        coordinator_address=env[contract.JAX_ADDRESSES_VAR].split(",")[0],
        num_processes=int(env[contract.JAX_NUM_PROCESSES_VAR]),
        process_id=process_id,
        local_device_ids=[int(i) for i in local_ids.split(",")] if local_ids else None,
        # The plan is complete: JAX's Slurm detection would keep one GPU per process.
        cluster_detection_method="deactivate",
        initialization_timeout=int(max(300.0, startup_timeout + JAX_TIMEOUT_MARGIN)),
    )
    gpus.check_jax_gpus(env)  # after initialize: listing devices first would start JAX's backends
    _private_apis.agree_on_random_seed()
    dist = _even_data_parallel_class()(devices=keras.distribution.list_devices())
    keras.distribution.set_distribution(dist)
    return dist


def chief_path(path: str) -> str:
    """``path`` on process 0; on the others the same file name in a private temporary
    directory, removed at exit.

    On JAX, ``model.save`` (and so ``ModelCheckpoint``) is a collective: every process
    must call it, or process 0 waits in an all-gather. With this only process 0 writes.
    """
    if cluster().is_chief:
        return path
    return os.path.join(_scratch_dir(), os.path.basename(os.path.normpath(path)))


def backup_and_restore(backup_dir: str, **kwargs: Any) -> Any:
    """Keras' ``BackupAndRestore`` for the jax layouts: resume a killed or requeued job.

    Every process reads the job's backup in ``backup_dir`` (so all resume at the same epoch)
    and saves at every epoch end (a collective on JAX), but only process 0 writes there, each
    file replaced whole; the others write to their private scratch directory. ``kwargs`` go to ``BackupAndRestore``
    (``save_freq``, ``double_checkpoint``, ``delete_checkpoint``).
    """
    import keras

    class JobBackupAndRestore(keras.callbacks.BackupAndRestore):
        def on_train_begin(self, logs: Any = None) -> None:
            super().on_train_begin(logs)  # every process reads the shared backup
            info = cluster()
            epoch = _private_apis.initial_epoch(self.model)
            if info.is_chief and epoch:
                logger.info(f"resuming from {self.backup_dir} (epoch {epoch} done).")
            if info.is_chief:
                _private_apis.save_backups_whole(self)  # a process stopped mid-save leaves the last backup whole
            else:
                _private_apis.write_backups_to(self, os.path.join(_scratch_dir(), "backup"))

    return JobBackupAndRestore(backup_dir, **kwargs)


def predict(model: Any, x: Any, *, batch_size: int | None = None, verbose: Any = 0, **_: Any) -> Any:
    """Every row of ``x``, in order, on every process of a jax layout (no collective).

    Keras' own ``model.predict`` fails there with several processes: its outputs span the
    devices of every process and cannot be read as NumPy ("Fetching value for `jax.Array`
    that spans non-addressable ... devices"). DataParallel replicates every variable, so
    each process predicts all rows on its first local device from its own copy of the
    weights, with the model's ``predict_step`` as Keras calls it.

    ``x``: arrays (a dict or list of them too) or a batched ``tf.data.Dataset`` of ``x``
    or ``(x, y[, sample_weight])``, as ``model.predict`` takes them.
    """
    import jax
    import keras
    import numpy as np

    device = jax.local_devices()[0]
    local = lambda v: jax.device_put(np.asarray(v.value.addressable_data(0)), device)  # noqa: E731
    state = ([local(v) for v in model.trainable_variables], [local(v) for v in model.non_trainable_variables])

    def step(state: Any, batch: Any) -> Any:
        return model.predict_step(state, batch)[0]  # Keras' JAX predict_step(state, data)

    run = jax.jit(step)
    outputs = []
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)  # one device: no sharding of inputs or outputs
    try:
        for batch in _local_batches(x, batch_size or 32):
            outputs.append(jax.tree_util.tree_map(np.asarray, run(state, batch)))
    finally:
        keras.distribution.set_distribution(previous)
    return jax.tree_util.tree_map(lambda *rows: np.concatenate(rows), *outputs)


def _local_batches(x: Any, batch_size: int) -> Any:
    """The ``data`` Keras' predict_step gets for each batch of ``x`` (arrays, or a batched
    tf.data.Dataset), as NumPy."""
    import keras
    import numpy as np
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        for element in x.as_numpy_iterator():
            inputs = keras.utils.unpack_x_y_sample_weight(element)[0] if isinstance(element, tuple) else element
            yield (inputs,) if isinstance(inputs, (list, tuple)) else inputs
        return
    n = len(keras.tree.flatten(x)[0])
    for start in range(0, n, batch_size):
        part = keras.tree.map_structure(lambda a: np.asarray(a)[start:start + batch_size], x)
        yield (part,) if isinstance(part, (list, tuple)) else part


@functools.cache
def _scratch_dir() -> str:
    scratch = tempfile.mkdtemp(prefix="keras_distrib-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


def _announce_joined(proc: Process) -> None:
    """Listen on this process's plan port for the rest of its life: the launcher's
    start-up watchdog counts the process as joined once it answers there."""
    host = proc.host if is_ip_address(proc.host) else ""  # a node name may resolve to 127.0.1.1 locally
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, proc.port))
    listener.listen(16)

    def answer() -> None:
        while True:
            connection, _ = listener.accept()
            connection.close()

    threading.Thread(target=answer, name="keras-distrib-joined", daemon=True).start()


@functools.cache
def _even_data_parallel_class() -> type:
    """keras.distribution.DataParallel whose dataset sharding never leaves a process short."""
    import keras

    class EvenDataParallel(keras.distribution.DataParallel):
        """DataParallel where every process gets the same number of equal batches per epoch."""

        def distribute_dataset(self, dataset: Any) -> Any:
            import tensorflow as tf

            if self.num_processes <= 1 or not self.auto_shard_dataset or not isinstance(dataset, tf.data.Dataset):
                return super().distribute_dataset(dataset)
            import jax

            return shard_evenly(dataset, jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count())

    return EvenDataParallel


def shard_evenly(dataset: Any, process_id: int, num_processes: int, num_devices: int, local_devices: int) -> Any:
    """This process's slice of every global batch of ``dataset``.

    A batch of ``b`` examples keeps ``b - b % num_devices`` (slices must be equal: the
    batch axis is split over every device); batches smaller than ``num_devices`` are
    skipped. Every process reads the same global batches, so all get the same count, as
    long as the dataset is deterministic (a seeded shuffle).
    """
    import tensorflow as tf

    leaves = tf.nest.flatten(dataset.element_spec)
    if not all(getattr(spec, "shape", None) is not None and spec.shape.rank for spec in leaves):
        raise ValueError(
            "model.fit on the jax layout needs a batched tf.data.Dataset (the batch is the global batch). "
            "HINT: add .batch(global_batch_size), e.g. dataset.shuffle(n, seed=1).batch(64)."
        )
    static_batch = _private_apis.declared_batch_size(dataset)
    if process_id == 0 and static_batch and static_batch % num_devices:
        logger.warning(f"the global batch {static_batch} does not divide by the {num_devices} devices; each batch keeps "
                       f"{static_batch - static_batch % num_devices} examples. Use a multiple of {num_devices} to keep "
                       "every example.")

    def batch_size(element: Any) -> Any:
        return tf.shape(tf.nest.flatten(element)[0])[0]

    def take_slice(*element: Any) -> Any:
        whole = element if len(element) > 1 else element[0]
        per_process = (batch_size(whole) // num_devices) * local_devices
        start = process_id * per_process
        return tf.nest.map_structure(lambda t: t[start : start + per_process], whole)

    kept = dataset.filter(lambda *element: batch_size(element) >= num_devices)
    return kept.map(take_slice, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
