"""`python -m keras_distrib.check`: run a small op on every ps and worker and print a table.

Started by the agent in place of the user's script (``--check`` or no SCRIPT), once
every server listens. Exit 0 when every task answered with the GPUs the plan gave it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from .check_table import CheckRow, report
from .network import wait_reachable
from .plan import CHIEF, JAX_LAYOUTS, Plan, Process
from . import contract


def probe(proc: Process, remote_devices: list[str], repeats: int = 5) -> CheckRow:
    """Median round trip of a tiny op on ``proc``'s CPU, and the GPUs it exposes."""
    import tensorflow as tf

    prefix = f"/job:{proc.job}/replica:0/task:{proc.index}/"
    gpus = tuple(d for d in remote_devices if d.startswith(prefix) and "/device:GPU:" in d)
    times = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            with tf.device(prefix + "device:CPU:0"):
                value = tf.reduce_sum(tf.ones([64]))
            if float(value.numpy()) != 64.0:
                return CheckRow(proc, gpus, None, "wrong result")
            times.append((time.perf_counter() - start) * 1000)
    except Exception as exc:  # any TF error means the task is not usable
        return CheckRow(proc, gpus, None, type(exc).__name__)
    return CheckRow(proc, gpus, statistics.median(times[1:]))


def main() -> int:
    if contract.layout(os.environ) in JAX_LAYOUTS:  # every process joins a cross-process sum
        from .jax_check import main as jax_main

        return jax_main()
    data = contract.read_plan(os.environ)
    if data is None:
        print(f"the cluster check runs under the launcher ({contract.PLAN_FILE_VAR} is not set)", file=sys.stderr)
        return 2
    plan = Plan.from_json(data, contract.protocol(os.environ))
    tasks = [p for p in plan.processes if p.job != CHIEF]
    print(f"cluster check: {plan.scheduler} job {plan.job_id}, layout {plan.layout}, {len(tasks)} task(s)")
    timeout = contract.startup_timeout(os.environ)
    unreachable = set(wait_reachable([p.address for p in tasks], timeout))
    if unreachable:
        # Connecting TensorFlow to a cluster with a dead task would block: report instead.
        rows = [CheckRow(p, (), None, f"unreachable after {timeout:.0f} s" if p.address in unreachable else "not probed")
                for p in tasks]
        return report(rows)
    import tensorflow as tf

    spec = plan.cluster_spec()
    # allreduce has no chief: the check joins as one, on the port the agent set aside.
    spec.setdefault(CHIEF, [f"{plan.processes[0].host}:{plan.control_port() + 1}"])
    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec), job_name=CHIEF, task_index=0, protocol=plan.protocol
    )
    devices = [d.name for d in tf.config.list_logical_devices()]
    return report([probe(p, devices) for p in tasks])


if __name__ == "__main__":
    sys.exit(main())
