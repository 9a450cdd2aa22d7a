"""Self-tests of the Slurm test cluster harness: does it behave like a real multi-node cluster?"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import SlurmTestCluster

pytestmark = pytest.mark.slurm

PY = sys.executable  # the venv's interpreter; jobs see the same filesystem


def test_srun_one_task_per_node(slurm_cluster: SlurmTestCluster) -> None:
    p = slurm_cluster.head(["srun", "-N3", "--ntasks-per-node=1", "hostname"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split()) == ["n1", "n2", "n3"]


def test_step_task_layout(slurm_cluster: SlurmTestCluster) -> None:
    script = 'echo "$SLURM_PROCID $SLURMD_NODENAME $(hostname) $SLURM_LOCALID $SLURM_NTASKS"'
    p = slurm_cluster.head(["srun", "-N3", "--ntasks-per-node=2", "sh", "-c", script], timeout=60)
    assert p.returncode == 0, p.stderr
    rows = sorted(tuple(line.split()) for line in p.stdout.splitlines())
    # Default block distribution: ranks 0,1 on n1; 2,3 on n2; 4,5 on n3.
    assert rows == [
        (str(rank), f"n{rank // 2 + 1}", f"n{rank // 2 + 1}", str(rank % 2), "6")
        for rank in range(6)
    ]


def test_jobs_use_callers_interpreter(slurm_cluster: SlurmTestCluster) -> None:
    # head() puts this interpreter's bin dir first on PATH, and jobs inherit srun's environment.
    code = "import sys, os; print(sys.prefix, os.environ.get('SLURM_CONF'))"
    p = slurm_cluster.head(["srun", "-N1", "-w", "n3", "python", "-c", code], timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [sys.prefix, str(slurm_cluster.conf_path)]


SERVER = """
import socket, sys
s = socket.socket()  # deliberately no SO_REUSEADDR/SO_REUSEPORT
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
conn, _ = s.accept()
conn.sendall(socket.gethostname().encode())
conn.close()
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    print(s.recv(100).decode())
"""
BIND = "import socket, sys; socket.socket().bind(('0.0.0.0', int(sys.argv[1])))"


def test_nodes_have_own_network(slurm_cluster: SlurmTestCluster) -> None:
    port, tag = 29500, "kdt-harness-sock-test"
    servers = {
        node: slurm_cluster.popen(node, [PY, "-c", SERVER, str(port), tag],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in ("n1", "n2")
    }
    try:
        for node, srv in servers.items():
            assert srv.stdout.readline().strip() == "ready", (node, srv.stderr.read())
        # Same port bound on two nodes at once: they have separate network namespaces...
        assert port in slurm_cluster.listening_ports("n1")
        assert port in slurm_cluster.listening_ports("n2")
        assert port not in slurm_cluster.listening_ports("n3")
        assert len(slurm_cluster.processes_matching(tag)) == 2
        # ...while a second bind inside one node does collide (so the check above means something).
        clash = slurm_cluster.on_node("n1", [PY, "-c", BIND, str(port)], timeout=30)
        assert clash.returncode != 0 and "Address already in use" in clash.stderr
        # Nodes reach each other by hostname over the private network.
        for client, server in (("n1", "n2"), ("n2", "n1")):
            p = slurm_cluster.on_node(client, [PY, "-c", CLIENT, server, str(port)], timeout=30)
            assert p.returncode == 0, p.stderr
            assert p.stdout.strip() == server
        for srv in servers.values():
            assert srv.wait(timeout=10) == 0
    finally:
        for srv in servers.values():
            srv.kill()
            srv.communicate()
    assert slurm_cluster.processes_matching(tag) == []


def test_sbatch_two_nodes(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        "#SBATCH -N2\n"
        f"#SBATCH -o {out}\n"
        'echo "nnodes=$SLURM_NNODES nodelist=$SLURM_JOB_NODELIST"\n'
        "srun hostname\n"
    )
    job = slurm_cluster.sbatch(script)
    result = slurm_cluster.wait_job(job, timeout=60)
    assert result == "COMPLETED", result.fields
    assert (result.exit_code, result.signal) == (0, 0)
    assert result.exit == "0:0"
    lines = out.read_text().split()
    assert lines[0] == "nnodes=2"
    assert lines[1] == "nodelist=n[1-2]"
    assert sorted(lines[2:]) == ["n1", "n2"]


def test_sbatch_failure_exit_code(slurm_cluster: SlurmTestCluster, tmp_path: Path) -> None:
    job = slurm_cluster.sbatch("#!/bin/sh\nexit 3\n", "-N1", "-o", str(tmp_path / "fail.out"))
    result = slurm_cluster.wait_job(job, timeout=60)
    assert result == "FAILED"
    assert (result.exit_code, result.signal) == (3, 0)


def _netns_names() -> list[str]:
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def test_throwaway_cluster_recovery_and_stop(slurm_cluster: SlurmTestCluster,
                                            tmp_path: Path) -> None:
    # A second, 1-node cluster with another prefix coexists with the session cluster.
    crashed = SlurmTestCluster(tmp_path / "a", nodes=1, prefix="kdtz")
    crashed.start()
    assert crashed.head(["srun", "hostname"], timeout=60).stdout.split() == ["n1"]
    # Simulate a crashed run: the lock is gone but daemons and namespaces are left behind.
    crashed._release_lock()
    fresh = SlurmTestCluster(tmp_path / "b", nodes=1, prefix="kdtz")
    fresh.start()  # must clean up the leftovers first
    try:
        assert fresh.head(["srun", "hostname"], timeout=60).stdout.split() == ["n1"]
        assert fresh.processes_matching(str(tmp_path / "a")) == []
    finally:
        fresh.stop()
    assert not [n for n in _netns_names() if n.startswith("kdtz-")]
    # No daemon of either run survives (their command lines name their slurm.conf).
    assert fresh.processes_matching(re.escape(str(tmp_path)), in_cluster=False) == []
    fresh.stop()  # idempotent
    crashed.stop()
    # The session cluster was not disturbed.
    p = slurm_cluster.head(["srun", "-N3", "hostname"], timeout=60)
    assert sorted(p.stdout.split()) == ["n1", "n2", "n3"], p.stderr


def test_a_cluster_that_started_munged_leaves_it_running_for_the_others(slurm_cluster: SlurmTestCluster,
                                                                         tmp_path: Path) -> None:
    """Two clusters at once (bench/chaos.py --prefix): the one that started munged stops first,
    and the other's Slurm RPCs must go on (they failed with "Zero Bytes were transmitted")."""
    from slurm_cluster import STATE_DIR

    owner = STATE_DIR / "munged.owner"
    before = owner.read_text() if owner.exists() else None
    other = SlurmTestCluster(tmp_path / "m", nodes=1, prefix="kdtm")
    other.start()
    try:
        owner.write_text("kdtm\n")  # as if it had started munged
        other.stop()
        assert SlurmTestCluster._munged_pids()
        p = slurm_cluster.head(["srun", "-N3", "hostname"], timeout=60)
        assert sorted(p.stdout.split()) == ["n1", "n2", "n3"], p.stderr
    finally:
        other.stop()
        if before is None:
            owner.unlink(missing_ok=True)
        else:
            owner.write_text(before)
