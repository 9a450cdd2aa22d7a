"""The agent-to-child contract: everything the launcher passes to a process it starts.

Written by the agent (``child_variables``, ``write_plan_file``) and read by the script
side (``read_plan``, ``read_task``, ``read_tf_cluster``) in this one module, so the two
sides cannot drift apart. Pure Python: imports neither TensorFlow nor the launcher.

Every child of an agent gets these variables:

=============================  ==============================================================
``KERAS_DISTRIB_PLAN_FILE``    path of the whole plan as JSON (``Plan.to_json()``): the
                               cluster, every process, layout, scheduler, job id. A file,
                               because Linux refuses any one variable over 128 KiB
                               (MAX_ARG_STRLEN): the plan passes that near 650 nodes.
``KERAS_DISTRIB_TASK``         this process's task, ``JOB:INDEX`` (``worker:3``).
``KERAS_DISTRIB_NODE``         the node it runs on (the scheduler's name).
``KERAS_DISTRIB_LAYOUT``       the layout (``ps-per-node``, ``worker-per-gpu``, ``allreduce``).
``KERAS_DISTRIB_PROTOCOL``     TF server protocol (``grpc``).
``KERAS_DISTRIB_STARTUP_TIMEOUT``  seconds to wait for the other tasks.
``TF_CONFIG``                  TensorFlow's own variable, for code that reads it directly
                               (legacy path): set only while it fits under
                               ``TF_CONFIG_LIMIT`` bytes (about 3,600 nodes of 8-character names in the ps
                               layouts, 7,200 in allreduce); above that it is absent and
                               only the plan file describes the cluster.
``CUDA_VISIBLE_DEVICES``       the GPUs the plan gives this process (empty: none).
``PYTHONUNBUFFERED``           ``1``, so output reaches the agent line by line.
``TF_CPP_MIN_LOG_LEVEL``       ``2`` unless the user set it or passed ``--verbose``.
``TF_NUM_INTEROP_THREADS``     ``2`` when the process may use only one CPU (its affinity:
                               ``srun --cpus-per-task=1``, ``taskset``), unless the user set
                               it. TensorFlow sizes its inter-op pool by the CPUs it may use,
                               and with one thread the parameter-server layouts deadlock
                               (measured: no step in 300 s; with 2 threads they train).
=============================  ==============================================================

The plan file lives in a private directory of the agent (mode 0700), one per node, and
is removed when the agent ends.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAN_FILE_VAR = "KERAS_DISTRIB_PLAN_FILE"
TASK_VAR = "KERAS_DISTRIB_TASK"
NODE_VAR = "KERAS_DISTRIB_NODE"
LAYOUT_VAR = "KERAS_DISTRIB_LAYOUT"
PROTOCOL_VAR = "KERAS_DISTRIB_PROTOCOL"
STARTUP_TIMEOUT_VAR = "KERAS_DISTRIB_STARTUP_TIMEOUT"
TF_CONFIG_VAR = "TF_CONFIG"
LOG_LEVEL_VAR = "TF_CPP_MIN_LOG_LEVEL"
# Linux's MAX_ARG_STRLEN is 32 pages (131,072 bytes) for "NAME=value\0"; stay well below
# so the rest of the environment and argv (ARG_MAX) keep room.
TF_CONFIG_LIMIT = 131_072 - len("TF_CONFIG=") - 1
INTEROP_THREADS_VAR = "TF_NUM_INTEROP_THREADS"
#: The fewest inter-op threads a child gets (see the table above).
MIN_INTEROP_THREADS = 2
# Hides TensorFlow's C++ INFO and WARNING lines (oneDNN, cuInit, CUDA drivers) in children.
QUIET_LOG_LEVEL = "2"
PLAN_FILE_NAME = "plan.json"


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


def remove_plan_file(path: Path) -> None:
    """Remove the plan file and its private directory (missing ones are fine)."""
    for victim in (path, path.with_suffix(".json.tmp")):
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


def child_variables(
    plan_file: Path,
    task: tuple[str, int],
    node: str,
    layout: str,
    protocol: str,
    startup_timeout: float,
    tf_config: str | None,
) -> dict[str, str]:
    """The keras_distrib variables of one child (TF_CONFIG only when it fits)."""
    variables = {
        PLAN_FILE_VAR: str(plan_file),
        TASK_VAR: f"{task[0]}:{task[1]}",
        NODE_VAR: node,
        LAYOUT_VAR: layout,
        PROTOCOL_VAR: protocol,
        STARTUP_TIMEOUT_VAR: str(startup_timeout),
    }
    if tf_config is not None and len(tf_config) <= TF_CONFIG_LIMIT:
        variables[TF_CONFIG_VAR] = tf_config
    return variables


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


def protocol(env: Mapping[str, str]) -> str:
    return env.get(PROTOCOL_VAR, "grpc")


def startup_timeout(env: Mapping[str, str]) -> float:
    return float(env.get(STARTUP_TIMEOUT_VAR, "180"))
# Resilience: the script's exit code after a checkpoint taken on SIGUSR1/SIGTERM (EX_TEMPFAIL:
# "try again later"), which the agent turns into a requeue; and the checkpoint interval.
PREEMPTED_EXIT_CODE = 75
CHECKPOINT_EVERY_VAR = "KERAS_DISTRIB_CHECKPOINT_EVERY"
