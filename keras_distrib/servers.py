"""`python -m keras_distrib.servers`: the TensorFlow server of one ps or worker task.

Reads its task and the cluster as contract.py says, serves until killed. The agent ends it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time

from . import contract
from ._private_apis import server_runtime
from .gpus import check_planned_gpus, tensorflow_built_with_cuda
from .logs import configure_script

# Named, not __name__: run as `python -m`, __name__ is "__main__", outside our logger tree.
logger = logging.getLogger("keras_distrib.servers")

#: After SIGTERM (preemption, scancel) a server keeps serving this long, so the chief can
#: write its checkpoint first (variables live on the ps); its agent kills it when done.
TERM_GRACE = 60.0

#: Imported by the whole ``import tensorflow`` (`server_runtime` falls back to it) when
#: installed, never needed by a server (it runs no Python of the user's): TensorFlow imports
#: Keras eagerly, Keras its scikit-learn wrapper and matplotlib gallery, TF Lite jax; each
#: import is guarded by ``except ImportError``.
#: Marked absent, they cost a server nothing (bench/launch_overhead.py measures it).
NOT_NEEDED_BY_A_SERVER = ("sklearn", "matplotlib", "jax")


def skip_optional_imports() -> None:
    """Make ``import NAME`` fail with ImportError in this process for each name above."""
    for name in NOT_NEEDED_BY_A_SERVER:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None: "not importable"


def _exit_later(signum: int, _frame: object) -> None:
    timer = threading.Timer(TERM_GRACE, os._exit, args=(128 + signum,))
    timer.daemon = True
    timer.start()


def main() -> None:
    # A crash inside TensorFlow's C++ (SIGSEGV, SIGABRT) then leaves its Python stacks in the
    # server's log instead of nothing.
    faulthandler.enable()
    # The agent forwards SIGUSR1 to every child so scripts can checkpoint on it; a server
    # must survive it (its default action would kill the process).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_later)
    configure_script(bare=True)  # the server's one line is its own: "serving ps:0 at ..."
    job, index = contract.read_task(os.environ)
    cluster = contract.read_tf_cluster(os.environ)
    protocol = contract.protocol(os.environ)

    skip_optional_imports()
    server_class, cluster_spec, list_physical_devices = server_runtime()
    server = server_class(cluster_spec(cluster), job_name=job, task_index=index, protocol=protocol, start=True)
    gpus = [d.name for d in list_physical_devices("GPU")]
    # The whole tensorflow module is imported only when GPUs are missing (to tell why).
    check_planned_gpus("TensorFlow", lambda: len(gpus), tensorflow_built_with_cuda, os.environ)
    address = cluster[job][index]
    logger.info(f"serving {job}:{index} at {address} over {protocol}; GPUs visible: {gpus or 'none'}")
    # Not server.join() (nor signal.pause()): the kernel may hand SIGTERM to one of
    # TensorFlow's threads, and Python runs the handler only when the main thread is back in
    # the interpreter, so the grace timer never started. A short sleep brings it back.
    while server is not None:
        time.sleep(0.5)


if __name__ == "__main__":
    main()
