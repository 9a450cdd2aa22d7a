"""The agent-to-child contract: everything the launcher passes to a process it starts.

Written by the agent (``child_env``, ``write_plan_file``) and read by the script side
(``read_plan``, ``read_task``, ``read_tf_cluster``) in this one module, so the two sides
cannot drift apart. Pure Python: imports neither TensorFlow nor the launcher (nor, at
run time, the plan, which imports nothing of this module).

``child_env`` is the one function that builds a child's environment, and ``VARIABLES``
the one table of every variable it may set (docs/launcher-internals.md shows the same
table; tests/unit/test_contract.py compares them, and checks that no other module spells
one of these names as a literal: they use the constants below).

The plan file lives in a private directory of the agent (mode 0700), one per node, and
is removed when the agent ends.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .network import is_ip_address

if TYPE_CHECKING:  # annotations only
    from .plan import Plan, Process

PLAN_FILE_VAR = "KERAS_DISTRIB_PLAN_FILE"
TASK_VAR = "KERAS_DISTRIB_TASK"
NODE_VAR = "KERAS_DISTRIB_NODE"
LAYOUT_VAR = "KERAS_DISTRIB_LAYOUT"
PROTOCOL_VAR = "KERAS_DISTRIB_PROTOCOL"
STARTUP_TIMEOUT_VAR = "KERAS_DISTRIB_STARTUP_TIMEOUT"
CHECKPOINT_EVERY_VAR = "KERAS_DISTRIB_CHECKPOINT_EVERY"
KD_LOG_LEVEL_VAR = "KERAS_DISTRIB_LOG_LEVEL"
TF_CONFIG_VAR = "TF_CONFIG"
CUDA_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"
REQUIRE_GPUS_VAR = "KERAS_DISTRIB_REQUIRE_GPUS"
UNBUFFERED_VAR = "PYTHONUNBUFFERED"
LOG_LEVEL_VAR = "TF_CPP_MIN_LOG_LEVEL"
INTEROP_THREADS_VAR = "TF_NUM_INTEROP_THREADS"
NCCL_IFNAME_VAR = "NCCL_SOCKET_IFNAME"
KERAS_BACKEND_VAR = "KERAS_BACKEND"
JAX_ADDRESSES_VAR = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
JAX_NUM_PROCESSES_VAR = "KERAS_DISTRIBUTION_NUM_PROCESSES"
JAX_PROCESS_ID_VAR = "KERAS_DISTRIBUTION_PROCESS_ID"
GPU_GROWTH_VAR = "TF_FORCE_GPU_ALLOW_GROWTH"
JAX_PREEMPTION_VAR = "JAX_ENABLE_PREEMPTION_SERVICE"
JAX_DEVICE_IDS_VAR = "JAX_LOCAL_DEVICE_IDS"
JAX_BIND_VAR = "JAX_COORDINATOR_BIND_ADDRESS"
PROGRESS_FILE_VAR = "KERAS_DISTRIB_PROGRESS_FILE"
TUNER_ID_VAR = "KERASTUNER_TUNER_ID"
ORACLE_IP_VAR = "KERASTUNER_ORACLE_IP"
ORACLE_PORT_VAR = "KERASTUNER_ORACLE_PORT"
XLA_FLAGS_VAR = "XLA_FLAGS"
#: What KerasTuner calls the process that runs its oracle.
ORACLE_TUNER_ID = "chief"
#: plan.TUNER_LAYOUT, spelled again: this module does not import the plan at run time.
TUNER_LAYOUT = "tuner"

#: Every variable ``child_env`` may set, with what it holds: the one table of the contract.
VARIABLES: dict[str, str] = {
    PLAN_FILE_VAR: "path of the whole plan as JSON (`Plan.to_json()`): the cluster, every process, layout, "
                   "scheduler, job id. A file, because Linux refuses any one variable over 128 KiB "
                   "(MAX_ARG_STRLEN): the plan passes that near 650 nodes.",
    TASK_VAR: "this process's task, `JOB:INDEX` (`worker:3`).",
    NODE_VAR: "the node it runs on (the scheduler's name).",
    LAYOUT_VAR: "the layout (`ps-per-node`, `worker-per-gpu`, `allreduce`, `jax`, `jax-per-gpu`, `tuner`).",
    PROTOCOL_VAR: "TF server protocol (`grpc`).",
    STARTUP_TIMEOUT_VAR: "seconds to wait for the other tasks (`--startup-timeout`).",
    PROGRESS_FILE_VAR: "path of this process's progress counter (16 bytes, next to the plan file): the trainers "
                       "add one per scheduled function done and mark when fit/evaluate run (keras_distrib.progress); "
                       "the agent's hang watchdog reads it (docs/faults.md, Hangs).",
    CHECKPOINT_EVERY_VAR: "the mid-epoch checkpoint interval, only when `--checkpoint-every` is given.",
    KD_LOG_LEVEL_VAR: "`DEBUG` with `--verbose`, unless set; otherwise as the agent got it (keras_distrib's "
                      "own log level in the child).",
    TF_CONFIG_VAR: "TensorFlow's own variable, for code that reads it directly (legacy path): set only while it "
                   "fits under `TF_CONFIG_LIMIT` bytes (about 3,600 nodes of 8-character names in the ps layouts, "
                   "7,200 in allreduce); above that it is absent (a stale one from the shell is removed) and only "
                   "the plan file describes the cluster. Never in layout tuner (its processes are not TF tasks).",
    CUDA_DEVICES_VAR: "the GPUs the plan gives this process (empty: none; TensorFlow's resolver cannot hide "
                      "GPUs from ps and chief processes, tensorflow#56894).",
    UNBUFFERED_VAR: "`1`, so output reaches the agent line by line.",
    LOG_LEVEL_VAR: "`2` unless the user set it or passed `--verbose` (TensorFlow's C++ INFO/WARNING lines).",
    INTEROP_THREADS_VAR: "`2` when the process may use only one CPU (its affinity: `srun --cpus-per-task=1`, "
                         "`taskset`), unless the user set it. TensorFlow sizes its inter-op pool by the CPUs it "
                         "may use, and with one thread the parameter-server layouts deadlock (measured: no step "
                         "in 300 s; with 2 threads they train).",
    NCCL_IFNAME_VAR: "allreduce with `--interface`: NCCL's bootstrap and socket transport use that network, "
                     "unless set.",
    KERAS_BACKEND_VAR: "jax layouts: `jax`.",
    JAX_ADDRESSES_VAR: "jax layouts: the coordinator's address (process 0, on its plan port) alone: a list of "
                       "every address would make each variable, and the plan, grow with the job.",
    JAX_NUM_PROCESSES_VAR: "jax layouts: the number of processes.",
    JAX_PROCESS_ID_VAR: "jax layouts: this process's index.",
    REQUIRE_GPUS_VAR: "`1` with `--require-gpus`: a process the plan gives GPUs exits with code 2 when its "
                      "framework sees fewer (else it warns in one line).",
    GPU_GROWTH_VAR: "jax layouts: `true`; TensorFlow (for tf.data) would otherwise reserve most of every "
                    "visible GPU's memory.",
    JAX_PREEMPTION_VAR: "jax layouts: `false`. JAX's preemption service catches SIGTERM and waits for the "
                        "training loop to call `reached_preemption_sync_point`, which `model.fit` never does: "
                        "the forwarded SIGTERM would be swallowed.",
    JAX_DEVICE_IDS_VAR: "jax layouts with GPUs: every GPU of the process, numbered as CUDA sees them once "
                        "`CUDA_VISIBLE_DEVICES` holds the plan's ids; without it JAX under Slurm would keep one "
                        "GPU per process (SLURM_LOCALID).",
    JAX_BIND_VAR: "jax layouts, process 0, when hosts are IP addresses (`--interface`, local mode): JAX's "
                  "coordinator listens on that address instead of `[::]`.",
    TUNER_ID_VAR: "layout tuner: `chief` for the oracle (the first node's first process), `tuner0`, `tuner1`, ... "
                  "for the trial workers; a restarted worker keeps its id, so the oracle gives it its trial again.",
    ORACLE_IP_VAR: "layout tuner: the oracle's host (the first node, as the plan reaches it).",
    ORACLE_PORT_VAR: "layout tuner: the oracle's port, the chief's plan port.",
    XLA_FLAGS_VAR: "processes that run Keras on JAX (jax layouts; the chief and workers of a ps layout on JAX; "
                   "every process of layout tuner under `KERAS_BACKEND=jax`), "
                   "with jaxlib 0.10: the user's flags plus `--xla_cpu_experimental_ynn_fusion_type=`, unless they "
                   "set that flag. XLA's CPU backend then runs convolutions with its own kernels instead of "
                   "YNNPACK's: 1.4-1.7x a small CNN's steps/s on x86, dense layers the same (docs/performance.md). "
                   "GPU computations are unchanged.",
}

#: jaxlib releases whose XLA knows `XLA_CPU_FLAG` (XLA stops a process at a flag it does not know).
XLA_CPU_FLAG_JAXLIB = "0.10."
XLA_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type="

# Linux's MAX_ARG_STRLEN is 32 pages (131,072 bytes) for "NAME=value\0"; stay well below
# so the rest of the environment and argv (ARG_MAX) keep room.
TF_CONFIG_LIMIT = 131_072 - len("TF_CONFIG=") - 1
#: The fewest inter-op threads a child gets (see the table above).
MIN_INTEROP_THREADS = 2
# Hides TensorFlow's C++ INFO and WARNING lines (oneDNN, cuInit, CUDA drivers) in children.
QUIET_LOG_LEVEL = "2"
PLAN_FILE_NAME = "plan.json"
PROGRESS_FILE_PREFIX = "progress-"
# Resilience: the script's exit code after a checkpoint taken on SIGUSR1/SIGTERM (EX_TEMPFAIL:
# "try again later"), which the agent turns into a requeue.
PREEMPTED_EXIT_CODE = 75
#: A child that stops because its setup is wrong (say, --require-gpus and no GPU seen) exits
#: with this code, after its one-line error: the agent fails the job with it at once, since
#: restarting the process cannot help.
SETUP_EXIT_CODE = 2


def write_plan_file(plan_json: str, directory: str | None = None) -> Path:
    """Write the plan into a new private directory (0700); returns the file's path.

    Written to a temporary name and renamed, so a reader never sees half a plan.
    """
    private = Path(tempfile.mkdtemp(prefix="keras_distrib-", dir=directory))
    tmp = private / (PLAN_FILE_NAME + ".tmp")
    tmp.write_text(plan_json)
    path = private / PLAN_FILE_NAME
    os.replace(tmp, path)
    return path


def rewrite_plan_file(path: Path, plan_json: str) -> None:
    """Replace the plan at ``path`` (an elastic re-forming), through a temporary name as ``write_plan_file``."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(plan_json)
    os.replace(tmp, path)


def progress_file(plan_file: Path, proc: Process) -> Path:
    """Where ``proc`` counts its progress: beside the plan file, in the agent's private directory."""
    return plan_file.parent / f"{PROGRESS_FILE_PREFIX}{proc.job}-{proc.index}"


def remove_plan_file(path: Path) -> None:
    """Remove the plan file, the progress files and their private directory (missing ones are fine)."""
    for victim in (path, path.with_suffix(".json.tmp"), *path.parent.glob(PROGRESS_FILE_PREFIX + "*")):
        try:
            victim.unlink()
        except FileNotFoundError:
            pass
    try:
        path.parent.rmdir()
    except OSError:
        pass


def tf_config_json(cluster: Mapping[str, list[str]] | str, job: str, index: int) -> str:
    """TensorFlow's TF_CONFIG for one task; ``cluster`` may come already JSON-encoded."""
    encoded = cluster if isinstance(cluster, str) else json.dumps(cluster)
    return f'{{"cluster": {encoded}, "task": {json.dumps({"type": job, "index": index})}}}'


def child_env(
    base: Mapping[str, str],
    plan: Plan,
    proc: Process,
    plan_file: Path,
    *,
    startup_timeout: float,
    verbose: bool = False,
    checkpoint_every: str | None = None,
    interface: str | None = None,
    cluster_json: str | None = None,
    cpus: int | None = None,
    require_gpus: bool = False,
) -> dict[str, str]:
    """The whole environment of one child: ``base`` (the agent's) plus the ``VARIABLES``.

    ``cluster_json``: the plan's cluster already JSON-encoded (an agent encodes it once for
    all its children); ``cpus``: the CPUs the child may use (default this process's
    affinity, which children inherit).
    """
    env = dict(base)
    # A stale TF_CONFIG from the user's shell must not survive when the plan's is too big.
    env.pop(TF_CONFIG_VAR, None)
    env.update({
        PLAN_FILE_VAR: str(plan_file),
        TASK_VAR: proc.name,
        NODE_VAR: proc.node,
        PROGRESS_FILE_VAR: str(progress_file(plan_file, proc)),
        LAYOUT_VAR: plan.layout,
        PROTOCOL_VAR: plan.protocol,
        STARTUP_TIMEOUT_VAR: str(startup_timeout),
        # Our ids are the ones the scheduler gave; an empty value hides every GPU, which
        # is what ps and chief processes need (tensorflow#56894: TF's resolver can't).
        CUDA_DEVICES_VAR: ",".join(proc.gpus),
        UNBUFFERED_VAR: "1",
    })
    cluster = cluster_json if cluster_json is not None else json.dumps(plan.cluster_spec())
    if plan.layout != TUNER_LAYOUT and len(cluster) < TF_CONFIG_LIMIT:  # cheap test first: the cluster alone may not fit
        tf_config = tf_config_json(cluster, proc.job, proc.index)
        if len(tf_config) <= TF_CONFIG_LIMIT:
            env[TF_CONFIG_VAR] = tf_config
    if verbose:
        env.setdefault(KD_LOG_LEVEL_VAR, "DEBUG")
    else:
        # One chatty C++ logger per process on a shared terminal is noise; users may override.
        env.setdefault(LOG_LEVEL_VAR, QUIET_LOG_LEVEL)
    if (len(os.sched_getaffinity(0)) if cpus is None else cpus) < MIN_INTEROP_THREADS:
        env.setdefault(INTEROP_THREADS_VAR, str(MIN_INTEROP_THREADS))
    if checkpoint_every is not None:
        env[CHECKPOINT_EVERY_VAR] = str(checkpoint_every)
    if require_gpus:
        env[REQUIRE_GPUS_VAR] = "1"
    if interface and plan.layout == "allreduce":
        env.setdefault(NCCL_IFNAME_VAR, interface)
    env.update(jax_variables(plan, proc))
    env.update(tuner_variables(plan, proc))
    env.update(xla_variables(plan, proc, env))
    return env


def xla_variables(plan: Plan, proc: Process, env: Mapping[str, str]) -> dict[str, str]:
    """`XLA_CPU_FLAG` added to ``env``'s XLA_FLAGS for a process that runs Keras on JAX (see
    ``VARIABLES``); empty for the others, for a user's XLA_FLAGS that sets it, and for a jaxlib
    that may not know it."""
    flags = env.get(XLA_FLAGS_VAR, "")
    # A tuner's trials run plain Keras on the backend the user chose (plan.backend covers the ps layouts).
    on_jax = plan.runs_keras_on_jax(proc) or (plan.layout == TUNER_LAYOUT and env.get(KERAS_BACKEND_VAR) == "jax")
    if not on_jax or XLA_CPU_FLAG.rstrip("=") in flags \
            or not installed_jaxlib().startswith(XLA_CPU_FLAG_JAXLIB):
        return {}
    return {XLA_FLAGS_VAR: f"{flags} {XLA_CPU_FLAG}".strip()}


@functools.cache
def installed_jaxlib() -> str:
    """The version of jaxlib the children will import (this interpreter's), or ``""``; read
    once per agent, not once per child."""
    from importlib import metadata

    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return ""


def tuner_variables(plan: Plan, proc: Process) -> dict[str, str]:
    """KerasTuner's distributed-mode variables for a process of layout tuner; empty for the others."""
    if plan.layout != TUNER_LAYOUT:
        return {}
    oracle = plan.processes[0]  # the first node's chief (plan.node_roles)
    return {
        TUNER_ID_VAR: ORACLE_TUNER_ID if proc == oracle else f"tuner{proc.index}",
        ORACLE_IP_VAR: oracle.host,
        ORACLE_PORT_VAR: str(oracle.port),
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    """``plan.to_json()`` with, on the jax layouts, each process's variables (``env``, see
    `jax_variables`): what ``--plan --format json`` prints."""
    data = plan.to_json()
    if plan.is_jax or plan.layout == TUNER_LAYOUT:
        for entry, proc in zip(data["processes"], plan.processes):
            entry["env"] = jax_variables(plan, proc) | tuner_variables(plan, proc)
    return data


def jax_variables(plan: Plan, proc: Process) -> dict[str, str]:
    """The variables a process of a jax layout needs (see ``VARIABLES``); empty for the others.

    ``keras.distribution.initialize()`` reads the KERAS_DISTRIBUTION_* ones; the
    coordinator is process 0 (every process of a jax layout is a worker).
    """
    if not plan.is_jax:
        return {}
    workers = sorted(plan.processes, key=lambda p: p.index)
    coordinator = workers[0]
    env = {
        KERAS_BACKEND_VAR: "jax",
        JAX_ADDRESSES_VAR: coordinator.address,
        JAX_NUM_PROCESSES_VAR: str(len(workers)),
        JAX_PROCESS_ID_VAR: str(proc.index),
        GPU_GROWTH_VAR: "true",
        JAX_PREEMPTION_VAR: "false",
    }
    if proc.gpus:
        env[JAX_DEVICE_IDS_VAR] = ",".join(str(i) for i in range(len(proc.gpus)))
    if proc.index == coordinator.index and is_ip_address(coordinator.host):
        # JAX's coordinator listens on [::]:port unless told; with --interface (or in
        # local mode) it listens on the chosen address only.
        env[JAX_BIND_VAR] = coordinator.address
    return env


def in_job(env: Mapping[str, str]) -> bool:
    """True when this process was started by an agent or given a TF_CONFIG by hand."""
    return PLAN_FILE_VAR in env or TF_CONFIG_VAR in env


def read_plan(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The plan JSON the agent wrote, or None for a process started by hand (TF_CONFIG only)."""
    path = env.get(PLAN_FILE_VAR)
    if not path:
        return None
    with open(path) as fh:
        return json.load(fh)


def read_task(env: Mapping[str, str]) -> tuple[str, int]:
    """This process's (job, index): from KERAS_DISTRIB_TASK, else TF_CONFIG's task."""
    task = env.get(TASK_VAR)
    if task:
        job, index = task.rsplit(":", 1)
        return job, int(index)
    config = json.loads(env[TF_CONFIG_VAR])
    return config["task"]["type"], int(config["task"]["index"])


def read_tf_cluster(env: Mapping[str, str]) -> dict[str, list[str]]:
    """The ClusterSpec dict: from the plan file when there is one, else TF_CONFIG."""
    plan = read_plan(env)
    if plan is not None:
        return plan["cluster"]
    return json.loads(env[TF_CONFIG_VAR])["cluster"]


def worker_count(env: Mapping[str, str]) -> int | None:
    """How many workers the job has now (it changes when an elastic job re-forms); None outside a job."""
    if not in_job(env):
        return None
    try:
        return len(read_tf_cluster(env).get("worker", ())) or None
    except (OSError, ValueError, KeyError):
        return None


def protocol(env: Mapping[str, str]) -> str:
    return env.get(PROTOCOL_VAR, "grpc")


def startup_timeout(env: Mapping[str, str]) -> float:
    return float(env.get(STARTUP_TIMEOUT_VAR, "180"))


def layout(env: Mapping[str, str]) -> str | None:
    """The job's layout, or None outside a launched job."""
    return env.get(LAYOUT_VAR) or None
