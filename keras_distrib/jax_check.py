"""The cluster check on the jax layouts: every process joins and runs a cross-process sum.

Run by the agent in every process in place of SCRIPT (``--check``, or no SCRIPT), through
``python -m keras_distrib.check``. Process 0 prints the same table as the other layouts.
"""

from __future__ import annotations

import time

from .check_table import CheckRow, report
from .strategies import cluster


def main() -> int:
    info = cluster()
    plan = info.plan
    if info.index == 0:
        print(f"cluster check: {plan.scheduler} job {plan.job_id}, layout {plan.layout}, {len(plan.processes)} process(es)",
              flush=True)
    from .jax_distribution import distribution

    distribution()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # Every device contributes (1 + its process index): a wrong process count or a
    # missing device changes the sum.
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    local = np.full((jax.local_device_count(),), jax.process_index() + 1, np.float32)
    values = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("devices")), local)
    total_of = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    float(total_of(values))  # compile and warm up
    start = time.perf_counter()
    total = float(total_of(values))
    sum_ms = (time.perf_counter() - start) * 1000
    gpus = sum(d.platform == "gpu" for d in jax.local_devices())
    mine = np.array([jax.process_index(), gpus, jax.local_device_count(), sum_ms], np.float64)
    rows_data = np.asarray(multihost_utils.process_allgather(mine))
    expected = sum((int(r[0]) + 1) * int(r[2]) for r in rows_data)
    error = "" if total == expected else f"cross-process sum {total:g} != {expected}"
    by_index = {int(r[0]): r for r in rows_data}
    rows = [
        CheckRow(p, tuple(str(i) for i in range(int(by_index[p.index][1]))), float(by_index[p.index][3]), error)
        if p.index in by_index else CheckRow(p, (), None, "did not join")
        for p in sorted(plan.processes, key=lambda p: p.index)
    ]
    if info.index == 0:
        print(f"cross-process sum over {jax.device_count()} device(s) of {jax.process_count()} process(es): "
              f"{total:g} (expected {expected})", flush=True)
        return report(rows)
    return 1 if any(not r.ok for r in rows) else 0
