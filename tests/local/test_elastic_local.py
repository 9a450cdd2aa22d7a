"""Node loss in local mode with --min-nodes: the job goes on on the nodes that are left.

Local mode runs one agent for every emulated node, without heartbeats, so the node loss
here is the one a spent restart budget makes: with --max-restarts 0 the SIGKILL of
local2's worker loses local2. The job must re-form on local0 and local1 (one line),
resume from its last checkpoint and end by itself with exit code 0, the exact step count
and nothing left running. One job per layout (the suite's time matters).
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest
from test_resilience_local import SCRIPT, Job, checkpoints

from launcher_utils import alive, listening_ports, wait_for

SEED = random.randrange(1 << 30)
LOST = re.compile(r"lost local2; continuing on 2 nodes \(local0, local1\) from the checkpoint at epoch (\d+), "
                  r"step (\d+) \(worker:2 on local2 exited with signal 9 \(SIGKILL\); the restart budget is spent \(0/0\)\)$")


@pytest.mark.parametrize(("layout", "port_base"), [("ps-per-node", 26000), ("allreduce", 26100)])
def test_a_lost_node_with_min_nodes_continues_on_the_survivors(tmp_path: Path, layout: str, port_base: int) -> None:
    ck = tmp_path / "ck"
    epochs, steps = 4, 150
    # --verbose: allreduce worker 1 is quiet by default, and its result line is compared.
    verbose = ["--verbose"] if layout == "allreduce" else []
    job = Job(["--nodes", "3", "--min-nodes", "2", "--max-restarts", "0", "--layout", layout, *verbose,
               "--port-base", str(port_base), "--checkpoint-every", "1s", "--startup-timeout", "600",
               str(SCRIPT), str(ck), str(epochs), str(steps)], tmp_path)
    try:
        assert wait_for(lambda: bool(checkpoints(ck)), 600), job.text()[-3000:]
        time.sleep(random.Random(SEED).uniform(0, 1.0))
        for task in ("worker:0", "worker:1"):
            job.pids(task)  # seen, to check none is left
        job.kill("worker:2")
        assert wait_for(lambda: job.count("; continuing on ") == 1, 120), job.text()[-3000:]
        assert wait_for(lambda: len(job.pids("worker:1")) == 1, 120)  # the new generation's, to check at the end
        assert job.pids("worker:2") == []  # local2 runs nothing of the new generation
        code = job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert code == 0, f"seed {SEED}\n{job.text()[-4000:]}"
    lost = [line for line in job.lines if "; continuing on " in line]
    print("\n".join(lost + [line for line in job.lines if "resuming " in line]))  # shown with -rP
    assert len(lost) == 1 and LOST.search(lost[0]), job.text()[-3000:]
    step = int(LOST.search(lost[0]).group(2))
    assert 0 < step < epochs * steps
    assert job.count("resuming from") == 1, job.text()[-3000:]  # the writer, once, after the re-forming
    assert job.count("resuming on 2 workers (the checkpoint was saved on 3)") == 1, job.text()[-3000:]
    if layout == "allreduce":
        first, second = job.result("[local0 worker:0]"), job.result("[local1 worker:1]")
        assert first["step"] == second["step"] == epochs * steps  # exact: steps_per_epoch is given
        assert first["weights"] == second["weights"]  # the replicas agree after the re-forming
    else:
        assert job.result("[local0 chief:0]")["step"] == epochs * steps
    assert not alive(sorted(job.seen))
    assert not {port_base + i for i in range(8)} & listening_ports()
