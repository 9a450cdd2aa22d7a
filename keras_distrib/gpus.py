"""GPUs the plan gives a process but its framework does not see: said in one line, or fatal.

A job that asks the scheduler for GPUs and then trains on the CPU without a word is the
most expensive silent failure on a GPU cluster. Every process the plan gives GPUs
(``CUDA_VISIBLE_DEVICES`` set by the agent) counts what TensorFlow (or JAX) sees when it
starts: a TF server, ``keras_distrib.strategy()``, ``keras_distrib.distribution()``.
Fewer than planned: one warning line naming the cause and the fix (the agent shows a line
every process repeats once), or, with ``--require-gpus``, the same line as an error and
exit code 2.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping

from . import contract

logger = logging.getLogger(__name__)

#: The exit code of a process that sees fewer GPUs than planned under --require-gpus.
MISSING_GPUS_EXIT_CODE = contract.SETUP_EXIT_CODE

#: How each framework's GPU build is installed.
GPU_BUILDS = {"TensorFlow": "pip install 'tensorflow[and-cuda]'", "JAX": "pip install 'jax[cuda12]'"}


def planned_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPU ids the plan gave this process (none outside a job, or for ps and chief)."""
    if not contract.in_job(environ):
        return []
    return [g for g in environ.get(contract.CUDA_DEVICES_VAR, "").split(",") if g.strip()]


def missing_gpus_line(framework: str, planned: int, seen: int, built_for_gpus: bool, required: bool = False) -> str | None:
    """The line for ``seen`` of ``planned`` GPUs (None: all are seen). ``built_for_gpus``:
    the framework's build has a GPU backend (TensorFlow with CUDA, JAX with its CUDA plugin);
    ``required``: --require-gpus (the process stops)."""
    if seen >= planned:
        return None
    if not built_for_gpus:
        cause = f"this {framework} has no GPU support"
        fix = f"install the GPU build in the job's environment: {GPU_BUILDS[framework]}"
    else:
        cause = "the GPU driver or CUDA libraries were not found, or CUDA_VISIBLE_DEVICES names GPUs this node lacks"
        fix = "run nvidia-smi on the node; load the CUDA module (or activate the environment) in the job script"
    outcome = "; stopping (--require-gpus)" if required else ", so it computes on the CPU"
    after = "" if required else "; --require-gpus makes this an error"
    return (f"the scheduler gave this process {planned} GPU(s) but {framework} sees {seen}: {cause}{outcome}. "
            f"HINT: {fix} (docs/gpus.md){after}.")


def check_planned_gpus(framework: str, count_seen: Callable[[], int], built_for_gpus: Callable[[], bool],
                       environ: Mapping[str, str]) -> None:
    """Warn (or, with --require-gpus, exit 2) when this process sees fewer GPUs than planned."""
    planned = planned_gpus(environ)
    if not planned:
        return
    seen = count_seen()
    if seen >= len(planned):  # all seen: the build is not asked about (a server imports less)
        return
    required = environ.get(contract.REQUIRE_GPUS_VAR) == "1"
    line = missing_gpus_line(framework, len(planned), seen, built_for_gpus(), required)
    if line is None:
        return
    if required:
        logger.error(line)
        sys.exit(MISSING_GPUS_EXIT_CODE)
    logger.warning(line)


def tensorflow_built_with_cuda() -> bool:
    from ._private_apis import is_cuda_build

    return is_cuda_build()


def check_tensorflow_gpus(environ: Mapping[str, str]) -> None:
    import tensorflow as tf

    check_planned_gpus("TensorFlow", lambda: len(tf.config.list_physical_devices("GPU")),
                       tensorflow_built_with_cuda, environ)


def check_jax_gpus(environ: Mapping[str, str]) -> None:
    import importlib.util

    import jax

    def gpus() -> int:
        try:
            return len(jax.devices("gpu"))
        except RuntimeError:  # no GPU backend could start
            return 0

    check_planned_gpus("JAX", gpus, lambda: any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None
                                                for v in (12, 13)), environ)
