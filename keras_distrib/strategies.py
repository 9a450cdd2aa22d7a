"""Inside SCRIPT: this process's place in the job, and the matching tf.distribute strategy."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import contract, gpus, progress
from .logs import configure_script
from .plan import CHIEF, JAX_LAYOUTS, PS, WORKER, Plan, Process

logger = logging.getLogger(__name__)


class NotInJobError(RuntimeError):
    """Raised when a helper that needs a running job is called outside one."""


class StrategyOrderError(RuntimeError):
    """Raised when the all-reduce strategy is requested after TensorFlow already ran ops."""


@dataclass(frozen=True)
class ClusterInfo:
    """What a process of a keras_distrib job knows about itself and the job."""

    plan: Plan
    job: str
    index: int

    @property
    def layout(self) -> str:
        return self.plan.layout

    @property
    def is_chief(self) -> bool:
        """True for the process that should write checkpoints and logs."""
        return self.job == CHIEF or (self.plan.every_process_runs_script and self.index == 0)

    @property
    def num_workers(self) -> int:
        return len(self.plan.cluster_spec().get(WORKER, []))

    @property
    def num_ps(self) -> int:
        return len(self.plan.cluster_spec().get(PS, []))


def cluster(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """This process's role and the whole plan, from what the agent passed (contract.py).

    A bare TF_CONFIG (processes started by hand) also works: the plan is read from its
    cluster, with the layout inferred (ps tasks -> ps-per-node, else allreduce).
    """
    env = os.environ if environ is None else environ
    if environ is None:
        progress.announce()
    if not contract.in_job(env):
        raise NotInJobError(
            f"not inside a keras_distrib job ({contract.PLAN_FILE_VAR} and TF_CONFIG are not set). "
            "HINT: run the script through the launcher: python -m keras_distrib.local --nodes 2 SCRIPT "
            "(one machine) or srun --ntasks-per-node=1 python -m keras_distrib.slurm SCRIPT."
        )
    protocol = contract.protocol(env)
    data = contract.read_plan(env)
    if data is not None:
        plan = Plan.from_json(data, protocol)
    else:
        plan = plan_from_cluster_spec(json.loads(env[contract.TF_CONFIG_VAR])["cluster"], protocol)
    job, index = contract.read_task(env)
    return ClusterInfo(plan, job, index)


def plan_from_cluster_spec(spec: Mapping[str, list[str]], protocol: str = "grpc") -> Plan:
    """A plan describing a hand-written ClusterSpec, each host taken as a node."""
    hosts = list(dict.fromkeys(address.rsplit(":", 1)[0] for addresses in spec.values() for address in addresses))
    processes = []
    for job in (CHIEF, PS, WORKER):
        for index, address in enumerate(spec.get(job, [])):
            host, port = address.rsplit(":", 1)
            processes.append(Process(host, hosts.index(host), job, index, host, int(port), ()))
    layout = "ps-per-node" if spec.get(PS) else "allreduce"
    return Plan("tf_config", "", tuple(hosts), layout, protocol, tuple(processes))


def connect_to_ps(plan: Plan, proc: Process) -> None:
    """Make this process a TensorFlow client of the ps tasks, serving on its plan port.

    Device filters keep it from reaching any other client: a dead or restarting worker
    never blocks the chief or another worker (the way TensorFlow's coordinator connects).
    """
    import tensorflow as tf

    spec = plan.cluster_spec()
    # This process only, in its own job, beside the ps tasks.
    cluster = tf.train.ClusterSpec({PS: spec[PS], proc.job: {proc.index: proc.address}})
    filters = tf.config.experimental.ClusterDeviceFilters()
    filters.set_device_filters(proc.job, proc.index, [f"/job:{PS}"])
    tf.config.experimental_connect_to_cluster(cluster, job_name=proc.job, task_index=proc.index,
                                              protocol=plan.protocol, cluster_device_filters=filters)
    logger.debug("%s connected to %d ps task(s)", proc.name, len(spec[PS]))


class AsyncJaxStrategy:
    """What ``keras_distrib.strategy()`` returns in a ps layout on JAX: this process is a
    TensorFlow client of the ps tasks. ``scope()`` does nothing (Keras on JAX places nothing)."""

    keras_distrib_kind = "jax-ps"

    def __init__(self, info: ClusterInfo) -> None:
        self.info = info
        self.proc = info.plan.find(info.job, info.index)
        connect_to_ps(info.plan, self.proc)

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def num_workers(self) -> int:
        return self.info.num_workers

    @property
    def num_ps(self) -> int:
        return self.info.num_ps


@functools.cache
def strategy() -> Any:
    """The strategy for this job's layout, created once per process.

    ps-per-node / worker-per-gpu: ParameterServerStrategy (this process is the chief).
    allreduce: MultiWorkerMirroredStrategy, NCCL collectives when GPUs are present.
    Outside a job (no plan file, no TF_CONFIG): TensorFlow's default single-process strategy, with one
    line saying so, so the same script runs on a laptop (`keras_distrib.fit` then calls
    ``model.fit``).
    """
    configure_script()
    if not contract.in_job(os.environ):
        import tensorflow as tf

        logger.info("not inside a keras_distrib job: running in this single process with plain Keras")
        return tf.distribute.get_strategy()
    info = cluster()
    if info.plan.backend == "jax":
        return AsyncJaxStrategy(info)
    if info.layout in JAX_LAYOUTS:
        raise NotInJobError(
            f"layout {info.layout} trains with keras.distribution on JAX, not tf.distribute (keras_distrib.strategy() "
            "and keras_distrib.fit() serve the parameter-server and all-reduce layouts). HINT: call "
            "keras_distrib.distribution() before building the model, then plain model.fit(dataset); or launch with "
            "--layout ps-per-node for asynchronous parameter servers on JAX."
        )
    import tensorflow as tf

    gpus.check_tensorflow_gpus(os.environ)  # lists devices only: no op runs, MultiWorkerMirroredStrategy may follow
    spec = tf.train.ClusterSpec(info.plan.cluster_spec())
    if info.layout == "allreduce":
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type=info.job, task_id=info.index, rpc_layer=info.plan.protocol
        )
        has_gpus = any(p.gpus for p in info.plan.processes)
        implementation = (
            tf.distribute.experimental.CommunicationImplementation.NCCL
            if has_gpus
            else tf.distribute.experimental.CommunicationImplementation.AUTO
        )
        try:
            return tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver,
                communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation),
            )
        except RuntimeError as exc:
            if "at program startup" not in str(exc):
                raise
            raise StrategyOrderError(
                "MultiWorkerMirroredStrategy must be created before any TensorFlow op runs in this process. "
                "HINT: call keras_distrib.strategy() at the top of the script, before building datasets or tensors."
            ) from None
    if info.job != CHIEF:
        raise NotInJobError(
            f"strategy() runs on the chief in layout {info.layout}, but this is {info.job}:{info.index}. "
            "HINT: only the chief runs SCRIPT in the parameter-server layouts; do not start it elsewhere."
        )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=CHIEF, task_id=0, rpc_layer=info.plan.protocol
    )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)
